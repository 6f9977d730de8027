"""n-gram (prompt lookup) speculative decoding: proposals from the request's own tokens; greedy tokens and log-probabilities
equal the target's alone, sampled tokens follow the target's distribution, and the commands reach it."""

from __future__ import annotations

import json

import pytest
import torch

from behemoth.inference import SamplingParams, load
from behemoth.inference.ngram import NgramDraft, NgramIndex, lookup
from behemoth.inference.speculative import point_masses, speculative_sample
from tests.test_generate import prompts
from tests.test_serve_speculative import PARAMS, folders  # noqa: F401  (folders: the module's fixture)

NGRAM = NgramDraft(tokens=4, max_n=3, min_n=1)


def test_lookup_proposes_what_followed_the_latest_longest_match():
    spec = NgramDraft(tokens=3, max_n=2, min_n=1)
    assert lookup([1, 2, 3, 9, 2, 3, 7, 8, 2, 3], NgramIndex(), spec, 3) == [7, 8, 2]  # (2, 3) last seen before 7
    assert lookup([5, 1, 6, 2, 1], NgramIndex(), spec, 3) == [6, 2, 1]  # no (2, 1) before: the 1-gram 1, its copy overlapping
    assert lookup([4, 5, 6], NgramIndex(), spec, 3) == []  # nothing repeats
    assert lookup([7, 7], NgramIndex(), spec, 3) == [7, 7, 7]  # a cycle proposed whole (the copy reads its own tokens)
    index, tokens = NgramIndex(), []
    for t in [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4]:  # extended token by token: as looked up afresh
        tokens.append(t)
        assert lookup(tokens, index, spec, 3) == lookup(tokens, NgramIndex(), spec, 3)
    assert lookup(tokens, index, spec, 2) == [1, 5]


def test_a_point_mass_proposal_keeps_the_target_distribution():
    """A deterministic proposal d is kept with probability p(d), else redrawn from p without d: the token is distributed
    as p (5,000 draws), and the acceptance is p(d)."""
    p = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    g = torch.Generator().manual_seed(0)
    counts, kept = torch.zeros(4), 0
    for _ in range(5000):
        out = speculative_sample(p, point_masses([1], 4), [1], g)
        counts[out[0]] += 1
        kept += len(out) == 2
    assert (counts / 5000 - p[0]).abs().max() < 0.025 and abs(kept / 5000 - 0.3) < 0.025


@pytest.fixture(scope="module")
def repeating(folders):  # noqa: F811
    return load(folders["repeating"])


@pytest.mark.parametrize("which", ["target", "repeating"])
def test_greedy_ngram_tokens_equal_the_target_alone(folders, repeating, which):  # noqa: F811
    gen = repeating if which == "repeating" else load(folders["target"])
    repeated = [3 * p for p in prompts(lengths=(5, 7, 2, 4))]  # prompts that repeat: lookup finds matches
    params = PARAMS if which == "target" else [SamplingParams(max_tokens=24, logprobs=1)] * 4  # penalties, stops; plain greedy
    gen.draft = None
    want, want_lp, plain = _run(gen, repeated, params)
    gen.draft = NGRAM
    got, got_lp, stats = _run(gen, repeated, params)
    assert got == want and stats["draft_tokens"] > 10
    assert all(torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4) for a, b in zip(got_lp, want_lp))
    if which == "repeating":  # its output cycles: nearly every proposal is kept, several tokens per step
        assert stats["accepted_tokens"] / stats["draft_tokens"] > 0.6 and stats["steps"] < 0.8 * plain["steps"]


def _run(gen, batch, params=PARAMS):
    sched = gen.scheduler()
    reqs = [sched.submit(p, sp) for p, sp in zip(batch, params)]
    sched.run_until_done()
    return [r.output for r in reqs], [[c.logprob for c in r.choices] for r in reqs], sched.stats


def test_sampled_ngram_repeats_exactly_under_preemption(repeating):
    from behemoth.inference.kv_cache import BlockAllocator
    from behemoth.inference.scheduler import Scheduler

    params = [SamplingParams(max_tokens=16, temperature=0.7, seed=s, top_p=0.95) for s in range(3)] + [SamplingParams(max_tokens=16)]
    batch = [2 * p for p in prompts()]
    repeating.draft = NGRAM
    first, _, stats = _run(repeating, batch, params)
    assert _run(repeating, batch, params)[0] == first and all(len(t) == 16 for t in first) and stats["accepted_tokens"] > 0
    repeating.draft = None
    greedy = _run(repeating, batch, params)[0][3]
    repeating.draft = NGRAM
    sched = repeating.scheduler()
    sched = Scheduler(repeating.runner, BlockAllocator(6, repeating.block_size), sched.policy, None, sched.speculative)
    reqs = [sched.submit(p, sp) for p, sp in zip(batch, params)]
    sched.run_until_done()
    assert reqs[3].output == greedy and sched.stats["preemptions"] > 0


def test_behemoth_generate_speculative_ngram_gives_the_plain_tokens(folders, capsys):  # noqa: F811
    from behemoth.cli import main

    ids = ",".join(map(str, 3 * prompts(lengths=(6,))[0]))
    argv = ["generate", folders["repeating"], "--prompt-ids", ids, "--max-tokens", "24", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--speculative", "ngram", "--draft-tokens", "5"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == plain["tokens"] and len(plain["tokens"]) == 24
    assert "speculative decoding:" in out.err and "proposed tokens accepted" in out.err, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--speculative", "ngram", "--draft", "{small}"], "one kind of proposal at a time"),
        (["serve", "--speculative", "ngram", "--ngram-min", "4"], "n-gram sizes 4..3: need 1 <= min <= max"),
        (["generate", "--speculative", "ngram", "--offload", "disk", "--prompt", "x"], "--speculative ngram with --offload disk"),
        (["generate", "--speculative", "ngram", "--draft-tokens", "0", "--prompt", "x"], "--draft-tokens 0"),
    ],
)
def test_ngram_options_are_refused_before_loading(folders, capsys, argv, message):  # noqa: F811
    from behemoth.cli import main

    argv = [argv[0], folders["target"], *(a.replace("{small}", folders["small"]) for a in argv[1:])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err
