"""Offloaded generation on training's unit runtime: the same logits and greedy tokens as in-memory generation, from
host memory and from disk, for GPT-2, Llama and a Mixtral saved in the legacy per-expert layout; under tp = 2 each rank
streams its own shard of every block and the tokens equal one process's and in-memory generation's; `behemoth generate
--offload` runs both and refuses what it cannot run before launch."""

from __future__ import annotations

import json

import pytest
import torch

from behemoth.inference import CachePolicy, SamplingParams, load
from tests.dist import run_ranks
from tests.test_generate import LLAMA, prompts, runtime, save_hf  # noqa: F401 (the runtime fixture)

transformers = pytest.importorskip("transformers")

MIXTRAL = ["model=gpt-tiny", "model=hf:mixtral", "model.n_layer=3", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64", "model.moe.experts=4"]
STEPS = [[(0, 7, 0)], [(0, 1, 7), (1, 3, 0)], [(1, 1, 3), (2, 9, 0), (0, 1, 8)], [(0, 1, 9), (1, 1, 4), (2, 1, 9)]]
GREEDY = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=6), SamplingParams(max_tokens=9)]


def save_mixtral(folder: str) -> None:
    """A random Mixtral saved by transformers' save_pretrained: its experts as per-expert w1 / w2 / w3 tensors."""
    from safetensors import safe_open

    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, MIXTRAL)
    torch.manual_seed(5)
    model = transformers.MixtralForCausalLM(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(folder)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()  # the legacy layout being read


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {arch: str(tmp_path_factory.mktemp(arch)) for arch in ("gpt2", "llama", "mixtral")}
    save_hf("gpt2", out["gpt2"])
    save_hf("llama", out["llama"])
    save_mixtral(out["mixtral"])
    return out


def step_logits(runner, vocab: int) -> list[torch.Tensor]:
    """The logits of prefills beside decodes at different positions, blocks of 4 tokens, greedy continuations."""
    from behemoth.inference.kv_cache import BlockAllocator, plan_step

    alloc = BlockAllocator(runner.storage.layout.num_blocks, 4)
    seqs = dict(enumerate(prompts(vocab, lengths=(7, 3, 9))))
    out = []
    for step in STEPS:
        rows = [(i, seqs[i][start : start + n], start) for i, n, start in step]
        for i, new, start in rows:
            alloc.grow(i, start + len(new))
        logits = runner.forward(plan_step(alloc, rows))
        for b, (i, new, start) in enumerate(rows):
            seqs[i] = seqs[i][: start + len(new)] + [int(logits[b].argmax())]
        out.append(logits)
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_offloaded_logits_and_tokens_equal_in_memory(runtime, folders, tmp_path, arch, tier):  # noqa: F811
    """Every forward's logits equal in-memory generation's (float32, the same arithmetic: within 1e-5 of the largest),
    the greedy tokens are the same, two blocks at most are held at once (prefetch 1), and every forward fetches every
    block once."""
    from behemoth.inference.generate import local_runner, offloaded_generator
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.offload import generation_policy

    source = resolve_source(folders[arch])
    vocab, n_layer = source.config.model.vocab_size, source.config.model.n_layer
    cache = CachePolicy(block_size=4, memory_mb=1)
    expected = step_logits(local_runner(load_model(source, runtime), cache), vocab)
    batch = prompts(vocab, lengths=(3, 8, 5))
    tokens = [c.tokens for c in load(source).generate(batch, GREEDY)]
    off = offloaded_generator(source, generation_policy(tier, tmp_path / "blocks", prefetch=1), cache, rt=runtime)
    try:
        got = step_logits(off.generator.runner, vocab)
        for e, g in zip(expected, got):
            assert float((g - e).abs().max()) <= 1e-5 * float(e.abs().max())
        assert [c.tokens for c in off.generator.generate(batch, GREEDY)] == tokens
        forwards = len(STEPS) + off.generator.stats["steps"]
        assert off.stats.fetched_bytes == forwards * off.streamed_bytes
        assert off.stats.peak_held <= (2 * off.streamed_bytes // n_layer if tier == "disk" else 0)
        if tier == "disk":
            assert len(list((tmp_path / "blocks").rglob("*.bin"))) == n_layer  # one file per block; embedding and head resident
    finally:
        off.close()
    assert not list((tmp_path / "blocks").rglob("*.bin"))  # working copies, removed


def _offloaded_tokens(folder: str, tier: str, blocks: str, batch: list[list[int]], params: list[dict], tp: int, rt=None) -> list[list[int]] | None:
    from behemoth.inference.generate import CachePolicy, generate_on_ranks
    from behemoth.inference.offload import generation_policy

    policy = generation_policy(tier, blocks)
    out = generate_on_ranks(folder, [], batch, params, tp=tp, pp=1, cache=CachePolicy(block_size=4, memory_mb=4), offload=policy, rt=rt)
    return None if out is None else [c.tokens for c in out]


def test_tensor_parallel_offloaded_generation_equals_one_process_and_in_memory(runtime, folders, tmp_path):  # noqa: F811
    """tp = 2, each rank streaming its half of every block of a Mixtral (grouped KV heads, experts split by width): the
    tokens of one offloaded process and of in-memory generation, greedy and sampled."""
    params = [dict(max_tokens=10), dict(max_tokens=7, temperature=0.7, seed=5), dict(max_tokens=10)]
    batch = prompts(lengths=(5, 11, 2))
    in_memory = [c.tokens for c in load(folders["mixtral"]).generate(batch, [SamplingParams(**p) for p in params])]
    single = _offloaded_tokens(folders["mixtral"], "host", str(tmp_path / "one"), batch, params, 1, rt=runtime)
    sharded = run_ranks(2, _offloaded_tokens, folders["mixtral"], "host", str(tmp_path / "two"), batch, params, 2)
    assert sharded[0] == single == in_memory and sharded[1] is None
    assert [len(t) for t in single] == [10, 7, 10]


def test_generate_offload_disk_under_tp_from_the_command_line(runtime, folders, tmp_path, capsys):  # noqa: F811
    """`behemoth generate --offload disk`, in one process and with `--nproc 2 --tp 2` (GPT-2: a tied, vocabulary-parallel
    head), prints in-memory generation's tokens; the blocks' folder is emptied afterwards."""
    from behemoth.cli import main

    argv = ["generate", folders["gpt2"], "--prompt-ids", "1,2,3", "--prompt-ids", "9,8", "--max-tokens", "6", "--json"]
    offload = ["--offload", "disk", "--offload-dir", str(tmp_path / "blocks")]
    runs = []
    for extra in ([], offload, [*offload, "--nproc", "2", "--tp", "2"]):
        assert main([*argv, *extra]) == 0
        runs.append([json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()])
    assert runs[0] == runs[1] == runs[2] and len(runs[0][0]) == 6
    assert not list((tmp_path / "blocks").rglob("*.bin"))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--offload", "disk", "--nproc", "2", "--pp", "2"], "--offload with --pp 2: every rank streams all of its blocks"),
        (["--offload", "cpu", "--quantize", "int8"], "--offload with --pp 1 and --quantize int8"),
    ],
)
def test_generate_offload_refuses_what_it_cannot_run_before_launch(folders, capsys, argv, message):
    from behemoth.cli import main

    assert main(["generate", folders["llama"], "--prompt-ids", "1,2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err
