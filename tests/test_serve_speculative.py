"""Speculative decoding: greedy tokens (and their log-probabilities) equal the target's alone, whatever the draft; a draft
equal to the target has every token accepted; the rejection rule keeps the target's distribution; preemption and
refusals."""

from __future__ import annotations

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.inference import SamplingParams, load
from behemoth.inference.speculative import speculative_sample
from tests.test_generate import LLAMA, prompts

transformers = pytest.importorskip("transformers")


def save_llama(folder: str, overrides: list[str], seed: int, std: float = 0.3) -> str:
    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, LLAMA + overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, std)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    mk = tmp_path_factory.mktemp
    yield {
        "target": save_llama(str(mk("target")), [], 7),
        "small": save_llama(str(mk("small")), ["model.n_layer=1"], 8),
        "wide_vocab": save_llama(str(mk("wide")), ["model.n_layer=1", "model.vocab_size=300"], 9),
        "repeating": save_llama(str(mk("repeating")), [], 7, std=0.05),  # a small init: its greedy output cycles
    }
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def target(folders):
    """One target generator; each test attaches its draft (`with_draft`)."""
    return load(folders["target"])


def with_draft(gen, folder: str | None, tokens: int = 3):
    from behemoth.inference.generate import draft_for
    from behemoth.topology import init_runtime

    gen.draft = None if folder is None else draft_for(gen, folder, tokens, init_runtime(), 8.0)
    return gen


PARAMS = [
    SamplingParams(max_tokens=20, logprobs=2),
    SamplingParams(max_tokens=13, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(max_tokens=17, repetition_penalty=1.3),
    SamplingParams(max_tokens=9, stop_token_ids=[5, 9, 17]),
]


def run(gen, params=PARAMS, lengths=(5, 11, 2, 8)):
    """Each request's tokens and log-probabilities, and the scheduler's counters."""
    sched = gen.scheduler()
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts(lengths=lengths), params)]
    sched.run_until_done()
    return [r.output for r in reqs], [[c.logprob for c in r.choices] for r in reqs], sched.stats


@pytest.mark.parametrize("draft", ["small", "target"])
def test_greedy_speculative_tokens_equal_the_target_alone(target, folders, draft):
    want, want_lp, plain = run(with_draft(target, None))
    got, got_lp, stats = run(with_draft(target, folders[draft]))
    assert got == want and stats["draft_tokens"] > 20
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4) for a, b in zip(got_lp, want_lp))
    rate = stats["accepted_tokens"] / stats["draft_tokens"]
    assert rate > 0.95 if draft == "target" else rate < 0.95  # the same model accepts (nearly) all; another refuses some
    assert draft == "small" or stats["steps"] * 2 < plain["steps"]  # up to 4 tokens a step


def test_the_rejection_rule_keeps_the_target_distribution():
    """d ~ q, kept with min(1, p/q), else redrawn from (p - q)+: the first token is distributed as p (5,000 draws; redrawing
    from p instead would put 0.35 on token 0, not 0.5)."""
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.2, 0.2]])
    g = torch.Generator().manual_seed(0)
    counts, kept = torch.zeros(5), 0
    for _ in range(5000):
        d = int(torch.multinomial(q[0], 1, generator=g))
        out = speculative_sample(p, q, [d], g)
        counts[out[0]] += 1
        kept += len(out) == 2
    assert (counts / 5000 - p[0]).abs().max() < 0.025
    assert abs(kept / 5000 - float(torch.minimum(p[0], q[0]).sum())) < 0.025  # acceptance = sum(min(p, q))
    same = speculative_sample(p[:1].repeat(3, 1), p[:1].repeat(2, 1), [0, 1], g)  # p == q: every draft kept, one more drawn
    assert same[:2] == [0, 1] and len(same) == 3


def test_sampled_speculative_with_the_target_as_draft_accepts_all_and_repeats(target, folders):
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, top_p=0.95) for s in range(4)]
    first, _, stats = run(with_draft(target, folders["target"], 4), params)
    assert stats["accepted_tokens"] / stats["draft_tokens"] > 0.95
    assert run(target, params)[0] == first and all(len(t) == 16 for t in first)


def test_speculative_under_preemption_changes_no_greedy_token(target, folders):
    from behemoth.inference.kv_cache import BlockAllocator
    from behemoth.inference.scheduler import Scheduler

    params = [SamplingParams(max_tokens=14)] * 4
    want, _, _ = run(with_draft(target, None), params)
    with_draft(target, folders["small"], 2)
    sched = target.scheduler()
    sched = Scheduler(target.runner, BlockAllocator(5, target.block_size), sched.policy, None, sched.speculative)
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts(), params)]
    sched.run_until_done()
    assert [r.output for r in reqs] == want and sched.stats["preemptions"] > 0


def test_a_bad_draft_is_refused_by_name(folders):
    with pytest.raises(BehemothError, match="vocabulary of 300, the target 256"):
        load(folders["target"], draft=folders["wide_vocab"])
    with pytest.raises(BehemothError, match="--draft-tokens 0"):
        load(folders["target"], draft=folders["small"], draft_tokens=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--draft", "{small}", "--draft-tokens", "0"], "--draft-tokens 0: a draft proposes at least one token per step"),
        (["--draft", "/no/such/folder"], "--draft /no/such/folder does not exist"),
        (["--adapter", "a={small}", "--prefix-caching"], "batched adapters run without it"),
        (["--adapter", "a=/no/such/folder"], "--adapter a=/no/such/folder: not a NAME=DIR of an adapter folder"),
        (["--prefill-chunk", "0"], "--prefill-chunk 0 is not a positive count"),
        (["--prefill-chunk", "big"], "--prefill-chunk big is neither a count of tokens nor auto"),
        (["--prefill-chunk", "auto", "--draft", "{small}"], "--prefill-chunk auto with --draft: its prompt chunks and decodes cannot share"),
        (["--prefill-step-factor", "2"], "--prefill-step-factor 2.0 without --prefill-chunk auto"),
    ],
)
def test_serve_refuses_bad_draft_adapter_and_chunk_options_before_loading(folders, capsys, argv, message):
    from behemoth.cli import main

    argv = [a.replace("{small}", folders["small"]) for a in argv]
    assert main(["serve", folders["target"], *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err
