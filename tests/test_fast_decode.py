"""The one-call decode step (inference/fast_decode.py) against the model's own blocks: same logits, same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from behemoth.config import load_config
from behemoth.inference import SamplingParams, load
from behemoth.inference.fast_decode import FusedDecoder, contiguous_start, halves
from behemoth.inference.generate import CachePolicy, local_runner
from behemoth.inference.kv_cache import BlockAllocator, plan_step
from behemoth.inference.loading import Source, load_model, resolve_source
from behemoth.topology import init_runtime
from tests.offline_tokenizer import build_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_llama(tmp_path_factory.mktemp("llama"), vocab_size=97)


def decode_logits(runner, prompts: list[list[int]], steps: int, interleave: bool = False) -> list[torch.Tensor]:
    """Prefill the prompts together, then `steps` greedy decode steps of every row: each step's logits [B, V]; with
    `interleave`, another sequence takes a block after each of the rows' blocks (their slots are not consecutive)."""
    alloc = BlockAllocator(runner.storage.layout.num_blocks, runner.storage.layout.block_size)
    seqs = [list(p) for p in prompts]
    rows = [(i, list(p), 0) for i, p in enumerate(prompts)]
    out = []
    for _ in range(steps + 1):
        for seq, tokens, start in rows:
            before = len(alloc.tables.get(seq, ()))
            alloc.grow(seq, start + len(tokens))
            if interleave and len(alloc.tables[seq]) > before:
                alloc.grow("other", alloc.lengths.get("other", 0) + alloc.block_size)
        logits = runner.forward(plan_step(alloc, rows))
        out.append(logits)
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            seqs[i].append(tok)
        rows = [(i, [s[-1]], len(s) - 1) for i, s in enumerate(seqs)]
    return out


def test_fused_decode_steps_equal_the_model_blocks(llama):
    model = load_model(resolve_source(llama, []), init_runtime())
    fused, plain = (local_runner(model, CachePolicy(block_size=4, max_blocks=16)) for _ in range(2))
    plain.fused = False
    prompts = [[3, 14, 15, 92, 65, 35, 8], [9, 79, 32]]  # rows of different lengths: different attended slots and masks
    a, b = decode_logits(fused, prompts, 10), decode_logits(plain, prompts, 10)
    assert isinstance(fused.fused, FusedDecoder)  # the decode steps took the one-call path
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_prepacked_matrices_give_the_views_numbers_bit_for_bit(llama, monkeypatch):
    """Where oneDNN runs the products (CPU float32), the fused decoder keeps each layer's matrices (and the untied head)
    in oneDNN's layout and multiplies several rows by them: the same logits, bit for bit, as a decoder without them
    (`PACK_LIMIT_BYTES` 0), for decode steps of two rows and the packed prefill before them."""
    from behemoth.inference import fast_decode

    model = load_model(resolve_source(llama, []), init_runtime())
    packed = local_runner(model, CachePolicy(block_size=4, max_blocks=16))
    prompts = [[3, 14, 15, 92, 65, 35, 8], [9, 79, 32]]
    a = decode_logits(packed, prompts, 6)
    if not fast_decode.onednn_products(torch.zeros(1)):
        pytest.skip("oneDNN does not run this process's products (not a CPU build with mkldnn, or float32 off)")
    assert packed.fused.packed is not None and all(w.is_mkldnn for w in packed.fused.packed[packed.layers[0]][1:3])
    monkeypatch.setattr(fast_decode, "PACK_LIMIT_BYTES", 0)
    views = local_runner(load_model(resolve_source(llama, []), init_runtime()), CachePolicy(block_size=4, max_blocks=16))
    b = decode_logits(views, prompts, 6)
    assert views.fused.packed is None
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_greedy_generation_is_identical_and_other_models_keep_their_blocks(llama):
    gen, ref = load(llama), load(llama)
    ref.runner.fused = False
    params = SamplingParams(max_tokens=24)
    prompts: list[str | list[int]] = [[5, 6, 7, 8], [11, 12]]
    ours = [c.tokens for c in gen.generate(prompts, params, ignore_eos=True)]
    assert ours == [c.tokens for c in ref.generate(prompts, params, ignore_eos=True)]
    assert isinstance(gen.runner.fused, FusedDecoder)
    gpt = load(Source(load_config(None, ["model=gpt-tiny", "model.context=64"]), None, None))
    gpt.generate([[1, 2, 3]], SamplingParams(max_tokens=3), ignore_eos=True)
    assert gpt.runner.fused is None  # behemoth's GPT blocks are not Llama layers: its decode steps run them as before


@pytest.mark.parametrize("interleave", [False, True])
def test_batch_one_steps_with_split_products_equal_the_model_blocks(llama, interleave):
    """One row: its products split over two threads, its cache read as a view of consecutive slots (or gathered where
    another sequence's blocks sit between its own)."""
    model = load_model(resolve_source(llama, []), init_runtime())
    fused, plain = (local_runner(model, CachePolicy(block_size=4, max_blocks=32)) for _ in range(2))
    fused.split_products, plain.fused = True, False
    a = decode_logits(fused, [[3, 14, 15, 92, 65]], 12, interleave)
    b = decode_logits(plain, [[3, 14, 15, 92, 65]], 12, interleave)
    assert isinstance(fused.fused, FusedDecoder) and fused.fused.split
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.fixture
def two_threads():
    """torch with two intra-op threads (a lone row's products then run as two batched halves), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_batch_one_steps_with_batched_halves_equal_the_model_blocks(llama, two_threads):
    """Two intra-op threads: a lone row's products run as one batched product of two halves ([2, in / 2, out] views of
    the fused matrices), a batch of two rows as plain products; both give the model's own blocks' logits."""
    model = load_model(resolve_source(llama, []), init_runtime())
    fused, plain = (local_runner(model, CachePolicy(block_size=4, max_blocks=32)) for _ in range(2))
    plain.fused = False
    for prompts in ([[3, 14, 15, 92, 65]], [[3, 14, 15, 92, 65], [9, 79, 32]]):
        a, b = decode_logits(fused, prompts, 10), decode_logits(plain, prompts, 10)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
            assert torch.equal(x.argmax(-1), y.argmax(-1))
    decoder = fused.fused
    assert isinstance(decoder, FusedDecoder) and decoder.halves is not None
    assert decoder.layer_weights(0, 1)[1].shape == (2, 16, 64) and decoder.layer_weights(0, 2)[1].shape == (64, 32)
    assert decoder.layer_weights(0, 1)[1].data_ptr() == decoder.weights[0][1].data_ptr()  # views: no weight copied


def test_batched_halves_greedy_generation_equals_transformers_generate(llama, two_threads):
    import transformers

    gen = load(llama)
    prompt = [5, 6, 7, 8, 9, 10]
    ours = gen.generate([prompt], SamplingParams(max_tokens=20), ignore_eos=True)[0].tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert isinstance(gen.runner.fused, FusedDecoder) and gen.runner.fused.halves is not None
    assert ours == ref[0, len(prompt) :].tolist()


def test_halves_need_an_even_number_of_inputs():
    weights = [torch.ones(6), torch.zeros(12, 6), torch.zeros(6, 4), torch.ones(6), torch.zeros(8, 6), torch.zeros(6, 4)]
    split = halves(weights)
    assert split is not None and [w.shape for w in split][1:3] == [(2, 3, 12), (2, 2, 6)]
    weights[5] = torch.zeros(6, 3)  # the down projection's three inputs cannot be halved
    assert halves(weights) is None


def test_contiguous_start():
    assert contiguous_start(torch.tensor([[8, 9, 10, 11, 12]])) == 8
    assert contiguous_start(torch.tensor([[0, 1, 2, 3, 8]])) == -1  # the next block is not the one after
    assert contiguous_start(torch.tensor([[4, 5, 6, 7, 0]])) == -1
    assert contiguous_start(torch.tensor([[0, 1], [2, 3]])) == -1  # two rows: gathered


def test_batch_one_greedy_generation_equals_transformers_generate(llama):
    import transformers

    gen = load(llama)
    gen.runner.split_products = True
    prompt = [5, 6, 7, 8, 9, 10]
    ours = gen.generate([prompt], SamplingParams(max_tokens=20), ignore_eos=True)[0].tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    assert isinstance(gen.runner.fused, FusedDecoder) and gen.runner.fused.split
    assert ours == ref[0, len(prompt) :].tolist()


def test_generate_with_split_products_from_the_command_line(llama, capsys):
    import json

    from behemoth.cli import main

    threads = torch.get_num_threads()
    try:
        assert main(["generate", llama, "--split-products", "--json", "--ignore-eos", "--max-tokens", "12", "--prompt-ids", "4,8,15,16"]) == 0
        assert torch.get_num_threads() == 1  # the split's two halves are its two threads
    finally:
        torch.set_num_threads(threads)
    tokens = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
    assert tokens == load(llama).generate([[4, 8, 15, 16]], SamplingParams(max_tokens=12), ignore_eos=True)[0].tokens


@pytest.mark.parametrize("onednn", [True, False])
def test_steps_of_several_tokens_per_row_equal_the_model_blocks(llama, onednn, monkeypatch):
    """A speculative check (a few new tokens per row, every row full) takes the one-call step, its products by oneDNN or
    F.linear, and gives the blocks' logits after every new token; a batch whose rows add different numbers of tokens
    (padding) runs the blocks."""
    from behemoth.inference import fast_decode
    from behemoth.inference.runner import fused_step

    monkeypatch.setattr(fast_decode, "ONEDNN_PRODUCTS", onednn)
    model = load_model(resolve_source(llama, []), init_runtime())
    fused, plain = (local_runner(model, CachePolicy(block_size=4, max_blocks=32)) for _ in range(2))
    plain.fused = False
    prompts = [[3, 14, 15, 92, 65, 35, 8, 9, 79, 32], [9, 79, 32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
    checks = [[(0, [5, 6, 7, 8], 10)], [(0, [5, 6, 7], 14), (1, [1, 2, 3], 20)], [(1, [40, 41], 23)]]
    steps = []
    for runner in (fused, plain):
        alloc = BlockAllocator(32, 4)
        for seq, p in enumerate(prompts):
            alloc.grow(seq, 40)
            runner.forward(plan_step(alloc, [(seq, p, 0)]))
        steps.append([runner.verify(plan_step(alloc, rows)) for rows in checks])
    calls = []
    decoder = fused.fused
    assert isinstance(decoder, FusedDecoder)
    for a, b in zip(*steps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    run = decoder.run
    decoder.run = lambda *args: calls.append(args[0].shape[:2]) or run(*args)  # type: ignore[method-assign]
    alloc = BlockAllocator(32, 4)
    alloc.grow(0, 12)
    fused.verify(plan_step(alloc, [(0, [1, 2, 3], 0)]))
    alloc.grow(1, 12)
    padded = plan_step(alloc, [(0, [4], 3), (1, [1, 2], 0)])
    fused.verify(padded)
    assert calls == [(1, 3)] and not fused_step(padded)  # the padded batch ran the model's blocks
