"""Serving features under tensor and pipeline parallelism, on the real multi-process path (gloo, bounded waits): KV
offload (each rank copies its own heads and layers of a preempted request to host memory and back) and n-gram
speculative decoding under --tp (job rank 0 proposes, every rank checks with its heads). A scheduler with too few
blocks preempts; every greedy token equals the single-process run's (itself transformers' greedy generation), and
seeded sampling equals it too where the run does not speculate. What still runs on one process is refused before loading."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks, wait_for_health
from tests.test_generate import hf_generate, prompts
from tests.test_serve_speculative import save_llama

transformers = pytest.importorskip("transformers")

BLOCK = 4
BLOCKS = 14  # the longest request needs 10 blocks alone; together they need 31: preemption
GREEDY = dict(max_tokens=16)
PARAMS = [GREEDY, dict(max_tokens=16, temperature=0.8, seed=3), GREEDY, GREEDY]


def batch() -> list[list[int]]:
    return [3 * p for p in prompts(lengths=(5, 7, 2, 4))]  # prompts that repeat: n-gram lookup finds matches


def _serve(
    folder: str,
    tp: int,
    pp: int,
    kv_offload: bool,
    ngram: bool | str,
    adapters: dict[str, str] | None = None,
    slots: list[int] | None = None,
    ep: int = 1,
    chunk: int | None = None,
) -> tuple[list[list[int]], dict[str, int]] | None:
    """One rank of a served model at tp x pp x ep: rank 0 schedules the batch over BLOCKS blocks (KV offload, speculation:
    n-gram when `ngram` is True, a draft model when it is the draft's folder, and batched adapters, row b with adapter
    slots[b], as asked; prompts in chunks of `chunk`), the others follow its steps; rank 0's outputs and counters."""
    from behemoth.inference.generate import CachePolicy, attach_adapters, attach_speculative, follow_model, generator_for
    from behemoth.inference.kv_cache import BlockAllocator
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.ngram import NgramDraft
    from behemoth.inference.sampling import SamplingParams
    from behemoth.inference.scheduler import Scheduler, SchedulerPolicy
    from behemoth.topology import init_runtime, one_rank_runtime

    source = resolve_source(folder, [])
    rt = init_runtime(timeout_s=60, tp=tp, pp=pp, ep=ep)
    draft_rt = one_rank_runtime(rt, 60) if isinstance(ngram, str) else rt
    model = load_model(source, rt, tp=tp, pp=pp, ep=ep)
    cache = CachePolicy(block_size=BLOCK, memory_mb=1)
    if rt.rank != 0:
        follow_model(model, cache, adapters=adapters)
        return None
    gen = generator_for(model, source, cache)
    try:
        if adapters:
            attach_adapters(gen, adapters)
        if ngram:
            attach_speculative(gen, ngram if isinstance(ngram, str) else NgramDraft(tokens=4), 3, draft_rt, 1.0)
        speculative = gen.scheduler().speculative
        policy = SchedulerPolicy(context=gen.context, kv_offload=kv_offload, prefill_chunk=chunk)
        sched = Scheduler(gen.runner, BlockAllocator(BLOCKS, BLOCK), policy, None, speculative)
        slots = slots or [0] * len(PARAMS)
        reqs = [sched.submit(p, SamplingParams(**sp, adapter=a)) for p, sp, a in zip(batch(), PARAMS, slots)]
        sched.run_until_done()
        return [r.output for r in reqs], dict(sched.stats)
    finally:
        gen.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_llama(str(tmp_path_factory.mktemp("repeating")), [], 7, std=0.05)  # 4 layers, 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def single(folder):
    """The single-process run: recomputation at preemption, no speculation."""
    out, stats = run_ranks(1, _serve, folder, 1, 1, False, False, timeout=60)[0]
    assert stats["preemptions"] > 0
    return out, stats


def test_the_single_process_run_is_transformers_greedy_generation(folder, single):
    greedy = [i for i, sp in enumerate(PARAMS) if sp is GREEDY]
    want = hf_generate(folder, [batch()[i] for i in greedy], max_new_tokens=16)
    assert [single[0][i] for i in greedy] == want


def test_packed_chunked_prefill_under_tp_equals_one_process(folder, single):
    """Chunks of 5 in one packed forward with the decodes, every rank running it with its heads, preempted mid-prefill."""
    ranks = run_ranks(2, _serve, folder, 2, 1, False, False, None, None, 1, 5, timeout=90)
    out, stats = ranks[0]
    assert out == single[0] and stats["mixed_steps"] > 0 and stats["preemptions"] > 0


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_kv_offload_under_tp_and_pp_equals_one_process(folder, single, tp, pp):
    ranks = run_ranks(tp * pp, _serve, folder, tp, pp, True, False, timeout=90)
    out, stats = ranks[0]
    assert out == single[0] and all(r is None for r in ranks[1:])
    assert stats["preemptions"] > 0 and stats["restored_tokens"] == stats["offloaded_tokens"] > 0
    assert stats["prefill_tokens"] < single[1]["prefill_tokens"]  # what came back from every rank's host memory was not recomputed


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_ngram_speculation_with_kv_offload_under_tp_and_pp_equals_one_process(folder, single, tp, pp):
    out, stats = run_ranks(tp * pp, _serve, folder, tp, pp, True, True, timeout=90)[0]
    assert [o for o, sp in zip(out, PARAMS) if sp is GREEDY] == [o for o, sp in zip(single[0], PARAMS) if sp is GREEDY]
    assert len(out[1]) == 16 and stats["accepted_tokens"] > 0 and stats["steps"] < single[1]["steps"]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return save_llama(str(tmp_path_factory.mktemp("draft")), ["model.n_layer=1"], 8, std=0.05)  # another model, one layer


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_a_draft_model_under_tp_and_pp_gives_the_one_process_greedy_tokens(folder, single, draft, tp, pp):
    """The draft runs whole on job rank 0 (a one-rank runtime of its own), the target split over the processes checks its
    proposals; with preemption (recomputation: the draft's cache of a preempted request is released and rebuilt)."""
    ranks = run_ranks(tp * pp, _serve, folder, tp, pp, False, draft, timeout=90)
    out, stats = ranks[0]
    assert [o for o, sp in zip(out, PARAMS) if sp is GREEDY] == [o for o, sp in zip(single[0], PARAMS) if sp is GREEDY]
    assert ranks[1] is None and len(out[1]) == 16 and stats["preemptions"] > 0
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"] and stats["steps"] < single[1]["steps"]


@pytest.fixture(scope="module")
def adapters(folder, tmp_path_factory):
    from tests.test_serve_adapters import save_adapter

    mk = tmp_path_factory.mktemp
    return {
        "support": save_adapter(folder, str(mk("support")), 4, ["q_proj", "v_proj"], 1),  # column-parallel layers
        "sql": save_adapter(folder, str(mk("sql")), 8, ["o_proj", "gate_proj", "down_proj"], 2),  # row- and column-parallel
    }


@pytest.fixture(scope="module")
def one_with_adapters(folder, adapters):
    return run_ranks(1, _serve, folder, 1, 1, False, False, adapters, ADAPTER_SLOTS, timeout=60)[0][0]


ADAPTER_SLOTS = [1, 2, 0, 2]  # support, sql, the base, sql: in one batch


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_batched_adapters_under_tp_and_pp_equal_one_process(folder, adapters, single, one_with_adapters, tp, pp):
    one = one_with_adapters
    ranks = run_ranks(tp * pp, _serve, folder, tp, pp, True, False, adapters, ADAPTER_SLOTS, timeout=90)
    assert ranks[0][0] == one and ranks[1] is None
    assert one[2] == single[0][2] and one[0] != single[0][0] and one[3] != single[0][3]  # base rows the base's; adapters matter


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--speculative", "ngram", "--offload", "host", "--nproc", "2", "--tp", "2", "--prompt", "x"], "with --offload host"),
        (["serve", "--adapter", "a={folder}", "--quantize", "int8"], "with --quantize int8: batched adapters run without it"),
    ],
)
def test_what_still_runs_on_one_process_is_refused_before_loading(folder, capsys, argv, message):
    from behemoth.cli import main

    assert main([argv[0], folder, *(a.replace("{folder}", folder) for a in argv[1:])]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err


def _one_process_texts(folder: str, adapters: dict[str, str], prompt: str, max_tokens: int) -> list[str]:
    """One process's greedy text of `prompt` with the base and with each batched adapter (in their slot order)."""
    from behemoth.inference import CachePolicy, SamplingParams, load
    from behemoth.inference.generate import attach_adapters

    gen = load(folder, cache=CachePolicy(block_size=4, memory_mb=2))
    attach_adapters(gen, adapters)
    params = [SamplingParams(max_tokens=max_tokens, adapter=slot) for slot in range(len(adapters) + 1)]
    return [c.text for c in gen.generate([prompt] * len(params), params, ignore_eos=True)]


@pytest.mark.slow
def test_the_command_line_server_under_tp_serves_offload_ngram_and_adapters_as_one_process(folder, adapters):
    """`behemoth serve --nproc 2 --tp 2 --kv-offload --speculative ngram --adapter NAME=DIR ...` (the launcher, every rank
    building its bank): the openai client naming the base and each adapter gets one process's greedy text."""
    import os
    import subprocess
    import sys

    openai = pytest.importorskip("openai")
    pytest.importorskip("httpx")
    from behemoth.faults.launch import free_port

    prompt, n = "abcabcabc", 12
    expected = run_ranks(1, _one_process_texts, folder, adapters, prompt, n)[0]
    port = free_port()
    named = [a for name, path in adapters.items() for a in ("--adapter", f"{name}={path}")]
    args = ["serve", folder, "--nproc", "2", "--tp", "2", "--port", str(port), "--block-size", "4", "--kv-cache-mb", "2"]
    args += ["--model-name", "base", "--kv-offload", "--speculative", "ngram", *named]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "behemoth", *args], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", 240)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        texts = [
            client.completions.create(model=m, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
            for m in ("base", *adapters)
        ]
        assert texts == expected and len(set(texts)) == len(texts)  # the adapters change the text: the comparison tests them
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def _cli_tokens(folder: str, *extra: str) -> list[list[int]]:
    import json
    import os
    import subprocess
    import sys

    ids = [a for p in batch() for a in ("--prompt-ids", ",".join(map(str, p)))]
    argv = [sys.executable, "-m", "behemoth", "generate", folder, "--json", "--max-tokens", "16", "--ignore-eos", "--block-size", "4", *ids, *extra]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert ("proposed tokens accepted" in out.stderr) == ("ngram" in extra or "--draft" in extra), out.stderr
    return [json.loads(line)["tokens"] for line in out.stdout.splitlines()]


@pytest.mark.slow
def test_the_command_line_generate_under_tp_speculates_with_ngram_as_one_process(folder):
    assert _cli_tokens(folder, "--nproc", "2", "--tp", "2", "--speculative", "ngram") == _cli_tokens(folder)


@pytest.mark.slow
def test_the_command_line_generate_under_pp_speculates_with_a_draft_as_one_process(folder, draft):
    assert _cli_tokens(folder, "--nproc", "2", "--pp", "2", "--draft", draft, "--draft-tokens", "3") == _cli_tokens(folder)
