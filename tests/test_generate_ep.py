"""Expert-parallel generation and serving (`--ep N`): each of N processes holds 1/N of every MoE layer's experts (read
as its slices of the checkpoint or save_pretrained folder), every rank runs the same requests, and each MoE layer's
tokens reach their experts' ranks by all-to-all (or the experts travel: the gather layout) at every prefill and decode
step. Greedy tokens equal one process's (and transformers' generate for a Mixtral folder); refusals come before
loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from behemoth.parallel.expert.dispatch import ExpertCompute
from tests.dist import run_ranks, wait_for_health
from tests.test_generate import prompts

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8


@dataclass
class CountedCompute(ExpertCompute):
    """A rank's expert computation, counting the rows it runs (its share of the layer's expert FLOPs)."""

    rows: int = 0

    def __call__(self, layer, rows, counts, weights):
        self.rows += rows.shape[0]
        return super().__call__(layer, rows, counts, weights)


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "behemoth", *argv], capture_output=True, text=True, timeout=timeout, env=env)


def cli_tokens(source: str, batch: list[list[int]], *extra: str) -> list[list[int]]:
    ids = [a for p in batch for a in ("--prompt-ids", ",".join(map(str, p)))]
    out = cli("generate", source, "--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--block-size", "4", *ids, *extra)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["tokens"] for line in out.stdout.splitlines()]


def _expert_generation(source: str, batch: list[list[int]], ep: int, tp: int = 1, layout: str = "owned") -> dict:
    """This rank's parameter bytes (experts, the rest) when loaded at `ep` x `tp`, the expert rows it computed, and the
    greedy tokens of the batch (rank 0) with the experts in `layout`."""
    from behemoth.inference import SamplingParams
    from behemoth.inference.generate import CachePolicy, follow_model, generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    source_ = resolve_source(source)
    rt = init_runtime(timeout_s=60, ep=ep, tp=tp)
    model = load_model(source_, rt, ep=ep, tp=tp, expert_layout=layout)
    assert model.experts is not None and model.experts.ep.size == ep
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    expert = sum(b for n, b in sizes.items() if model.experts.is_expert(n))
    counted = model.experts.compute = CountedCompute(model.experts.tp)  # the runner computes through it from here on
    model.experts.set_layout(layout if ep > 1 else "alltoall")
    cache, tokens = CachePolicy(4, 2), None
    if rt.rank == 0:
        gen = generator_for(model, source_, cache)
        tokens = [c.tokens for c in gen.generate(batch, SamplingParams(max_tokens=MAX_TOKENS), ignore_eos=True)]
        gen.close()
    else:
        follow_model(model, cache)
    return {"expert_bytes": expert, "other_bytes": sum(sizes.values()) - expert, "rows": counted.rows, "tokens": tokens}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """behemoth's gpt-moe-tiny trained 4 steps in one process, checkpointed at the end."""
    from tests.common import tiny_config, train_body

    run = tmp_path_factory.mktemp("moe-run")
    run_ranks(1, train_body, tiny_config(run, "model=gpt-moe-tiny", "train.steps=4", "checkpoint.every=4", "train.eval_every=0"))
    return run


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from tests.test_generate_offload import save_mixtral

    folder = str(tmp_path_factory.mktemp("mixtral"))
    save_mixtral(folder)
    return folder


def mixtral_expected(folder: str, batch: list[list[int]]) -> list[list[int]]:
    hf = transformers.MixtralForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    greedy = dict(do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return [hf.generate(torch.tensor([p]), **greedy)[0, len(p) :].tolist() for p in batch]


def full_expert_bytes(source: str) -> int:
    """The expert bytes of the whole model (one process holds them all), counted on the meta device."""
    from behemoth.inference.loading import resolve_source
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.parallel.expert import plan_expert_parallel

    cfg = resolve_source(source).config
    lm = build_causal_lm(cfg.model, cfg.hf)
    experts = plan_expert_parallel(lm.module, 1, layers=lm.moe_layers)
    return sum(p.numel() * p.element_size() for n, p in lm.module.named_parameters() if experts.is_expert(n))


def test_generate_cli_ep2_on_a_mixtral_folder_equals_transformers(mixtral):
    """`behemoth generate --nproc 2 --ep 2` on a Mixtral save_pretrained folder (per-expert tensors): its greedy tokens are
    transformers' generate's (which one process's equal: tests/test_serve_fixes.py)."""
    batch = [[3, 9, 27, 81, 5], [100, 2]]
    assert cli_tokens(mixtral, batch, "--nproc", "2", "--ep", "2") == mixtral_expected(mixtral, batch)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["owned", "alltoall", "gather"])
def test_mixtral_at_ep2_holds_half_the_expert_bytes_and_equals_transformers(mixtral, layout):
    """In every expert layout a rank holds half of the expert bytes, the rest whole, and generates transformers' tokens."""
    batch = [[3, 9, 27, 81, 5], [100, 2]]
    two = run_ranks(2, _expert_generation, mixtral, batch, 2, 1, layout)
    assert two[0]["tokens"] == mixtral_expected(mixtral, batch) and two[1]["tokens"] is None
    assert all(r["expert_bytes"] * 2 == full_expert_bytes(mixtral) for r in two) and two[0]["other_bytes"] == two[1]["other_bytes"] > 0
    if layout == "gather":  # every rank runs every expert on all of its rows
        assert two[0]["rows"] == two[1]["rows"] > 0


@pytest.mark.slow
def test_mixtral_at_ep2_tp2_equals_transformers(mixtral):
    """--ep 2 composes with --tp 2 (4 processes): attention heads and the KV cache split over tp, experts over ep and
    each expert's width over tp; a rank holds a quarter of the expert bytes, and the tokens are transformers'."""
    batch = [[3, 9, 27, 81, 5], [100, 2]]
    four = run_ranks(4, _expert_generation, mixtral, batch, 2, 2)
    assert four[0]["tokens"] == mixtral_expected(mixtral, batch) and all(r["tokens"] is None for r in four[1:])
    assert all(r["expert_bytes"] * 4 == full_expert_bytes(mixtral) for r in four)


@pytest.mark.slow
def test_generate_ep2_on_a_trained_moe_run_equals_one_process(moe_run):
    """`behemoth generate --nproc 2 --ep 2` reads each rank's experts from a checkpoint saved by one process; its greedy
    tokens are one process's, and each rank holds half of the expert bytes (the rest whole)."""
    batch = prompts(lengths=(5, 9, 2))
    one, two = run_ranks(1, _expert_generation, str(moe_run), batch, 1)[0], run_ranks(2, _expert_generation, str(moe_run), batch, 2)
    assert two[0]["tokens"] == one["tokens"] and two[1]["tokens"] is None
    assert [len(t) for t in one["tokens"]] == [MAX_TOKENS] * 3
    assert one["expert_bytes"] == full_expert_bytes(str(moe_run))
    assert all(r["expert_bytes"] * 2 == one["expert_bytes"] > 0 and r["other_bytes"] == one["other_bytes"] for r in two)
    assert two[0]["rows"] + two[1]["rows"] == one["rows"] and all(r["rows"] < one["rows"] for r in two)  # owned: 1/ep of the work
    assert cli_tokens(str(moe_run), batch, "--nproc", "2", "--ep", "2", "--expert-layout", "alltoall") == one["tokens"]


def _one_process_text(folder: str, prompt: str) -> str:
    from behemoth.inference import CachePolicy, SamplingParams, load

    gen = load(folder, cache=CachePolicy(block_size=4, memory_mb=2))
    return gen.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS), ignore_eos=True)[0].text


@pytest.mark.slow
def test_the_server_at_ep2_answers_as_one_process(mixtral):
    """`behemoth serve --nproc 2 --ep 2`: rank 0 runs HTTP and the scheduler, the other rank follows its steps; the
    openai client's completion is one process's text."""

    openai = pytest.importorskip("openai")
    pytest.importorskip("httpx")
    from behemoth.faults.launch import free_port

    expected = run_ranks(1, _one_process_text, mixtral, "abc")[0]
    port = free_port()
    args = ["serve", mixtral, "--nproc", "2", "--ep", "2", "--port", str(port), "--block-size", "4", "--kv-cache-mb", "2", "--model-name", "mixtral"]
    proc = subprocess.Popen([sys.executable, "-m", "behemoth", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", 240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        done = client.completions.create(model="mixtral", prompt="abc", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].text == expected and done.usage.completion_tokens == MAX_TOKENS
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--ep", "3"], "--ep 3 does not divide the 4 experts of an MoE layer"),
        (["--ep", "2", "--nproc", "3"], "--nproc 3 but --tp 1 x --pp 1 x --ep 2 = 2"),
        (["--ep", "2", "--pp", "2"], "--ep 2 with --pp 2: expert-parallel generation replicates the other layers"),
        (["--ep", "2", "--offload", "host"], "--ep 2 with --offload host"),
        (["--ep", "0"], "--ep 0 is not a positive degree"),
    ],
)
def test_ep_refusals_come_before_loading(mixtral, capsys, argv, message):
    from behemoth.cli import main

    assert main(["generate", mixtral, "--prompt-ids", "1,2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_ep_on_a_dense_model_is_refused_before_loading(tmp_path, capsys):
    from behemoth.cli import main
    from tests.test_generate import save_hf

    save_hf("llama", str(tmp_path))
    for argv in (["generate", str(tmp_path), "--prompt-ids", "1,2", "--ep", "2"], ["serve", str(tmp_path), "--ep", "2"]):
        assert main(argv) == 2
        assert "--ep 2 but the model has no experts" in capsys.readouterr().err
