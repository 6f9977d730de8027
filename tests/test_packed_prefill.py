"""Packed steps of several tokens per row (inference/packed_prefill.py) against the model's own blocks: the same logits at
every real position, the same greedy tokens through the scheduler (chunked prefill, prefix caching)."""

from __future__ import annotations

import pytest
import torch

from behemoth.inference import SamplingParams, load, packed_prefill
from behemoth.inference.fast_decode import FusedDecoder
from behemoth.inference.generate import CachePolicy, local_runner
from behemoth.inference.kv_cache import BlockAllocator, plan_step
from behemoth.inference.loading import load_model, resolve_source
from behemoth.inference.scheduler import SchedulerPolicy
from behemoth.topology import init_runtime
from tests.offline_tokenizer import build_llama

PROMPTS = [[3, 14, 15, 92, 65, 35, 8, 97 - 1], [9, 79, 32], [2, 7, 1, 8, 28, 18, 28, 45, 90, 45, 23, 53]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_llama(tmp_path_factory.mktemp("llama"), vocab_size=97)


def steps() -> list[list[tuple[int, list[int], int]]]:
    """(sequence, new tokens, first position) per row of three steps: fresh prompts of different lengths with the third
    prompt's first chunk; then its second chunk (cached positions before it) beside one-token rows and a speculative-check
    shaped row of three tokens; then its last chunk alone."""
    a, b, c = PROMPTS
    return [
        [(0, a, 0), (1, b, 0), (2, c[:5], 0)],
        [(2, c[5:9], 5), (0, [4], len(a)), (1, [6, 60, 61], len(b))],
        [(2, c[9:], 9)],
    ]


def run_steps(runner) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every step's logits after each new token ([B, T, V]) and hidden states, blocks of the rows interleaved (another
    sequence takes a block between theirs, so no row's slots are consecutive)."""
    alloc = BlockAllocator(runner.storage.layout.num_blocks, runner.storage.layout.block_size)
    logits, hidden = [], []
    for rows in steps():
        for seq, tokens, start in rows:
            alloc.grow(seq, start + len(tokens))
            alloc.grow("other", alloc.lengths.get("other", 0) + alloc.block_size)
        batch = plan_step(alloc, rows)
        hidden.append(runner.hidden(batch))
        logits.append(runner.verify(batch))
    return logits, hidden


@pytest.mark.parametrize("tile", [None, 5], ids=["one-tile", "tiles-of-5"])
def test_packed_steps_equal_the_model_blocks(llama, tile, monkeypatch):
    """Every step's logits and hidden states equal the blocks' at every real position; with tiles of 5 tokens (smaller
    than the rows, so tiles cut across rows) as with the whole step in one tile."""
    if tile is not None:
        monkeypatch.setattr(packed_prefill, "TILE", tile)
    model = load_model(resolve_source(llama, []), init_runtime())
    packed, plain = (local_runner(model, CachePolicy(block_size=4, max_blocks=64)) for _ in range(2))
    plain.fused = False
    (ours, ours_h), (ref, ref_h) = run_steps(packed), run_steps(plain)
    assert isinstance(packed.fused, FusedDecoder)
    for rows, x, y, hx, hy in zip(steps(), ours, ref, ours_h, ref_h):
        valid = torch.arange(x.shape[1]) < torch.tensor([len(t) for _, t, _ in rows]).unsqueeze(1)
        torch.testing.assert_close(x[valid], y[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(x[valid].argmax(-1), y[valid].argmax(-1))
        if not valid.all():  # the packed path computed no padding position (the blocks' path did)
            assert not hx[~valid].any() and hy[~valid].any()


@pytest.mark.parametrize("policy", [dict(prefill_chunk=5), dict(prefix_caching=True)], ids=["chunked", "prefix-cache"])
def test_scheduled_greedy_tokens_equal_the_model_blocks(llama, policy):
    """Through the scheduler: prompts prefilled in chunks of 5 tokens beside running decodes, or sharing a cached prefix
    (a later prompt prefills only its tail, attending to the cached blocks), give the blocks' tokens."""
    gen, ref = load(llama, cache=CachePolicy(block_size=4)), load(llama, cache=CachePolicy(block_size=4))
    ref.runner.fused = False
    prompts = [*PROMPTS, PROMPTS[2][:8] + [11, 12, 13, 14, 15]]  # the last one shares two blocks with the third
    out = []
    for g in (gen, ref):
        sched = g.scheduler(SchedulerPolicy(max_batch=2, context=g.context, **policy))
        requests = [sched.submit(p, SamplingParams(max_tokens=8)) for p in prompts]
        sched.run_until_done()
        out.append([r.output for r in requests])
        if policy.get("prefix_caching"):
            assert sched.stats["prefix_hit_tokens"] >= 8
    assert out[0] == out[1]
    assert isinstance(gen.runner.fused, FusedDecoder) and gen.runner.packed_prefill
