"""Chunked prefill: a long prompt admitted while a stream decodes is prefilled `prefill_chunk` tokens per step, in one
packed forward with the decodes, the stream gets a token at every step meanwhile, and every request's greedy tokens equal
those of whole-prompt prefill."""

from __future__ import annotations

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.inference import SamplingParams
from behemoth.inference.scheduler import SchedulerPolicy


class CountingRunner:
    """The real runner, recording how many new tokens each forward carried."""

    def __init__(self, inner) -> None:
        self.inner, self.vocab_size, self.sizes = inner, inner.vocab_size, []
        self.packs_rows = inner.packs_rows

    def forward(self, batch):
        self.sizes.append(int(batch.lengths.sum()))
        return self.inner.forward(batch)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_arrival(gen, policy: SchedulerPolicy, *, arrive_at: int = 3, long: int = 120, sched=None) -> tuple[list[list[int]], list[int], dict]:
    """A stream decodes; at step `arrive_at` two long prompts arrive. Every request's tokens, the steps at which the stream got
    its tokens, and per step: the prompt tokens prefilled, the forwards run and the decoding requests."""
    sched = sched or gen.scheduler(policy)
    runner = sched.runner = CountingRunner(gen.runner)
    greedy = SamplingParams(max_tokens=40)
    stream = sched.submit(prompt(6, 0), greedy)
    got_at, others, steps = [], [], {"prefill": [], "forwards": [], "decoding": [], "prefix": []}
    for step in range(400):
        if step == arrive_at:
            others = [sched.submit(prompt(long, 1), SamplingParams(max_tokens=12)), sched.submit(prompt(long - 37, 2), SamplingParams(max_tokens=9))]
        before, prefilled, forwards = len(stream.output), sched.stats["prefill_tokens"], len(runner.sizes)
        steps["decoding"].append(sum(r.prefilled for r in sched.running))
        steps["prefix"].append(next((r.cached for r in sched.running if not r.prefilled), 0))
        sched.step()
        steps["prefill"].append(sched.stats["prefill_tokens"] - prefilled)
        steps["forwards"].append(len(runner.sizes) - forwards)
        if len(stream.output) > before:
            got_at.append(step)
        if sched.idle and step > arrive_at:
            break
    return [r.output for r in [stream, *others]], got_at, steps


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunked_prefill_keeps_a_stream_decoding_and_changes_no_token(gpt_tiny_generator, prefix_caching):
    whole, whole_at, whole_steps = run_arrival(gpt_tiny_generator, SchedulerPolicy(context=gpt_tiny_generator.context, prefix_caching=prefix_caching))
    chunked, chunked_at, steps = run_arrival(
        gpt_tiny_generator, SchedulerPolicy(context=gpt_tiny_generator.context, prefix_caching=prefix_caching, prefill_chunk=16)
    )
    assert chunked == whole and all(len(t) > 5 for t in whole)
    assert max(steps["prefill"]) == 16 and max(whole_steps["prefill"]) >= 203  # both long prompts in one forward without chunks
    assert chunked_at == list(range(len(chunked[0])))  # a token at every step while 203 prompt tokens go in 16 at a time
    assert max(steps["forwards"]) == 1 and max(whole_steps["forwards"]) == 2  # a chunk rides in the decodes' forward


def test_chunked_prefill_under_preemption_and_sampling_changes_no_token(gpt_tiny_generator):
    """A cache too small for every request: chunked prompts are preempted mid-prefill and recomputed; seeded sampling too."""
    from behemoth.inference.kv_cache import BlockAllocator
    from behemoth.inference.scheduler import Scheduler

    def run(chunk):
        policy = SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk=chunk)
        sched = Scheduler(gpt_tiny_generator.runner, BlockAllocator(24, 8), policy)
        params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=25, temperature=0.8, seed=3), SamplingParams(max_tokens=20)]
        reqs = [sched.submit(prompt(n, i), p) for i, (n, p) in enumerate(zip((50, 40, 60), params))]
        sched.run_until_done()
        return [r.output for r in reqs], sched.stats["preemptions"]

    (whole, _), (chunked, preempted) = run(None), run(7)
    assert chunked == whole and preempted > 0


def test_a_prefill_chunk_below_one_is_refused_by_name():
    with pytest.raises(BehemothError, match="prefill chunk of 0 tokens"):
        SchedulerPolicy(prefill_chunk=0)
