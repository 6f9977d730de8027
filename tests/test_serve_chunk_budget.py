"""Chunked prefill's measured budget (`--prefill-chunk auto`): the rule (the largest chunk whose predicted mixed step is
within the factor of a decode-only step) on given step times; packed steps give every row the logits of its own
forward (also under a sliding window); with the budget measured on the model, or a given one, every token equals
whole-prompt prefill's and a stream's gap is bounded in tokens computed while long prompts arrive."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, plan_packed_step, plan_step
from behemoth.inference.scheduler import Scheduler, SchedulerPolicy
from behemoth.inference.step_budget import Observed, StepBudget, StepCosts
from tests.test_serve_chunked import prompt, run_arrival

MS = 1e-3


DECODE = {1: 10.0 * MS, 4: 11.5 * MS, 16: 17.5 * MS}  # a line: 9.5 ms + 0.5 ms per row
SHALLOW = {4: 13.0 * MS, 8: 14.0 * MS, 16: 16.0 * MS, 32: 20.5 * MS, 64: 28.0 * MS}  # 4 decodes + a chunk at position 0


def costs(shallow=SHALLOW, deep_extra: float = 3.9 * MS) -> StepCosts:
    return StepCosts(4, DECODE, dict(shallow), {c: t + deep_extra for c, t in shallow.items()}, 960)


def test_the_chunk_is_the_largest_whose_step_is_within_the_factor():
    budget = StepBudget(costs(), factor=1.5, cap=4096)
    # 4 decodes: the limit is 1.5 x 11.5 = 17.25 ms; at position 0 the line 16 -> 20.5 ms (16 -> 32 tokens) crosses it at 20.4
    assert budget.chunk(4, 0) == 20
    assert budget.chunk(4, 960) == 5  # 3.9 ms more at the end of the context: 16.9 ms at 4 tokens, 17.9 at 8
    assert budget.chunk(4, 480) == 13  # half way: 1.95 ms more, 15.95 ms at 8 tokens, 17.95 at 16
    assert budget.chunk(16, 0) == 31  # 16 decodes: limit 26.25 ms, the mixed step 6 ms more: 22 ms at 16, 26.5 at 32
    assert budget.chunk(0, 0) == 4096  # nothing decodes: no stream to stall, whole prompts up to the cap
    assert budget.costs.decode_time(32) == pytest.approx(25.5 * MS)  # past 16 rows along the last segment
    assert budget.costs.mixed_time(16, 4, 1200) == pytest.approx((16 + 3.9 * 1.25) * MS)  # past the deep prefix along its line
    for rows, prefix in ((4, 0), (4, 960), (4, 480), (16, 0), (9, 300)):
        c, limit = budget.chunk(rows, prefix), 1.5 * budget.costs.decode_time(rows)
        assert budget.costs.mixed_time(c, rows, prefix) <= limit < budget.costs.mixed_time(c + 1, rows, prefix)


def test_the_budget_never_extrapolates_and_ignores_noise():
    assert StepBudget(costs(), factor=3.0).chunk(4, 0) == 64  # within 3x at every measured chunk: the largest measured
    assert StepBudget(costs(), factor=1.5, cap=10).chunk(4, 0) == 10
    assert StepBudget(costs(deep_extra=20 * MS), factor=1.5).chunk(4, 960) == 4  # none within: the smallest, so a prompt advances
    noisy = {**SHALLOW, 32: 15.0 * MS}  # a noisy 32 that looks cheaper than 16: the envelope keeps 16 ms
    assert StepBudget(costs(noisy), factor=1.5).chunk(4, 0) == 35  # 16 ms at 32, 28 at 64: 17.125 ms at 35


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StepBudget(costs(), factor=1.0), "a prefill step factor of 1.0"),
        (lambda: SchedulerPolicy(prefill_chunk="auto", step_factor=0.9), "a prefill step factor of 0.9"),
        (lambda: SchedulerPolicy(prefill_chunk="big"), "a prefill chunk of 'big' tokens"),
        (lambda: SchedulerPolicy(prefill_chunk=0), "a prefill chunk of 0 tokens"),
        (lambda: StepCosts(4, {4: MS}, SHALLOW, SHALLOW, 960), "decode batches \\[4\\]"),
    ],
)
def test_bad_budget_values_are_refused_by_name(make, message):
    with pytest.raises(BehemothError, match=message):
        make()


def test_auto_is_refused_where_a_chunk_cannot_share_the_decodes_forward(gpt_tiny_generator):
    class OneRowRunner:  # a runner of one sequence per row (as a pipeline's or a streamed model's)
        vocab_size = gpt_tiny_generator.runner.vocab_size
        forward = gpt_tiny_generator.runner.forward

    with pytest.raises(BehemothError, match="cannot share one forward"):
        Scheduler(OneRowRunner(), BlockAllocator(64, 8), SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk="auto"))


def packed_vs_rows(runner, alloc: BlockAllocator, rows) -> None:
    """The packed step's logits equal each row's own forward (the same keys written first)."""
    for seq, tokens, start in rows:
        alloc.grow(seq, start + len(tokens))
        if start:
            runner.forward(plan_step(alloc, [(seq, prompt(start, 7 + start), 0)]))
    packed = runner.forward(plan_packed_step(alloc, rows))
    alone = torch.cat([runner.forward(plan_step(alloc, [row])) for row in rows])
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert packed.shape[0] == len(rows) and not torch.allclose(packed[0], packed[1])


def test_a_packed_step_gives_each_sequence_its_own_logits(gpt_tiny_generator, tmp_path):
    rows = [("chunk", prompt(13, 1), 20), ("a", [5], 30), ("b", [9], 7), ("c", prompt(4, 2), 0)]
    packed_vs_rows(gpt_tiny_generator.runner, BlockAllocator(gpt_tiny_generator.num_blocks, gpt_tiny_generator.block_size), rows)
    from behemoth.inference import CachePolicy, load
    from tests.test_hf_families import save_family

    for family in ("llama", "mistral"):  # Llama: the fused decoder runs the packed row; Mistral's window of 8: the model's
        save_family(family, tmp_path / family)  # own blocks, the packed keys keeping their own positions
        gen = load(str(tmp_path / family), cache=CachePolicy(block_size=4, memory_mb=1))
        rows = [("chunk", prompt(9, 3), 12), ("a", [5], 20), ("b", [7], 3)]
        packed_vs_rows(gen.runner, BlockAllocator(gen.num_blocks, gen.block_size), rows)
        assert (gen.runner.fused not in (None, False)) == (family == "llama")


def test_auto_budget_changes_no_token_and_is_measured_on_the_model(gpt_tiny_generator):
    whole, _, _ = run_arrival(gpt_tiny_generator, SchedulerPolicy(context=gpt_tiny_generator.context))
    sched = gpt_tiny_generator.scheduler(SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk="auto"))
    c = sched.budget.costs
    assert min(c.decode.values()) > 0 and len(c.shallow) >= 2 and c.deep_prefix == gpt_tiny_generator.context - 32  # chunks up to 192 / 4
    assert "within 1.5x of a decode-only step" in sched.budget.describe() and sched.budget.observed is not None
    sched.budget = replace(sched.budget, observed=None)  # the rule alone: the served steps' correction is tested below
    chunked, got_at, steps = run_arrival(gpt_tiny_generator, sched.policy, sched=sched)
    assert chunked == whole and got_at == list(range(len(chunked[0])))
    for i, (n, rows, prefix) in enumerate(zip(steps["prefill"], steps["decoding"], steps["prefix"])):
        assert n <= sched.budget.chunk(rows, prefix) or rows == 0, i  # each step within its budget


def test_served_steps_slower_than_measured_shrink_the_chunk():
    """Mixed steps 20% over their prediction: the limit shrinks by 1/1.2 (9 tokens instead of 20 at position 0); mixed
    steps as fast as predicted bring it back; the scale is bounded."""
    observed = Observed(clock=lambda: 0.0)
    budget = StepBudget(costs(), factor=1.5, observed=observed)
    assert budget.chunk(4, 0) == 20 and observed.scale == 1.0  # nothing seen yet: the measured rule
    for _ in range(30):
        observed.observe_mixed(1.2 * budget.costs.mixed_time(20, 4, 0), budget.costs.mixed_time(20, 4, 0))
    assert observed.scale == pytest.approx(1 / 1.2)
    limit = 1.5 * 11.5 * MS / 1.2  # 14.375 ms: on the line 14 -> 16 ms (8 -> 16 tokens) at 9.5
    assert budget.chunk(4, 0) == 9 and budget.costs.mixed_time(9, 4, 0) <= limit < budget.costs.mixed_time(10, 4, 0)
    for _ in range(60):
        observed.observe_mixed(budget.costs.mixed_time(9, 4, 0), budget.costs.mixed_time(9, 4, 0))
    assert observed.scale == pytest.approx(1.0, abs=1e-3) and budget.chunk(4, 0) == 20
    for _ in range(60):
        observed.observe_mixed(100 * MS, MS)
    assert observed.scale == 0.25 and budget.chunk(4, 0) == 4  # bounded; a prompt still advances


def test_the_scheduler_times_its_mixed_steps_for_the_budget(gpt_tiny_generator):
    sched = gpt_tiny_generator.scheduler(SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk="auto"))
    chunked, _, steps = run_arrival(gpt_tiny_generator, sched.policy, sched=sched)
    observed = sched.budget.observed
    mixed = sum(1 for n, rows in zip(steps["prefill"], steps["decoding"]) if n and rows)
    assert observed.mixed_steps == mixed > 0 and 0.25 <= observed.scale <= 4.0 and observed.mixed > 0


def test_a_streams_gap_is_bounded_in_tokens_while_long_prompts_arrive(gpt_tiny_generator):
    """A given budget (12 tokens beside 1-2 decodes): between two of the stream's tokens the model computes at most the
    decodes and 12 prompt tokens, in one forward per step."""
    policy = SchedulerPolicy(context=gpt_tiny_generator.context, prefill_chunk="auto", step_factor=13.1 / 9)
    flat = {c: 10 * MS + c * MS / 4 for c in (4, 8, 16, 32, 64)}  # 11 ms at 4 tokens, 13 at 12, 14 at 16; the limit 13.1 ms
    budget = StepBudget(StepCosts(4, {1: 9 * MS, 4: 9 * MS}, flat, flat, 96), factor=policy.step_factor, cap=4096)
    sched = Scheduler(gpt_tiny_generator.runner, BlockAllocator(gpt_tiny_generator.num_blocks, gpt_tiny_generator.block_size), policy, budget=budget)
    whole, _, _ = run_arrival(gpt_tiny_generator, SchedulerPolicy(context=gpt_tiny_generator.context))
    chunked, got_at, steps = run_arrival(gpt_tiny_generator, policy, sched=sched)
    assert chunked == whole and got_at == list(range(len(chunked[0])))
    while_prefilling = [(n, rows) for n, rows in zip(steps["prefill"], steps["decoding"]) if n and rows]
    assert len(while_prefilling) >= 203 // 12 and max(n for n, _ in while_prefilling) == 12
    assert max(n + rows for n, rows in while_prefilling) <= 12 + 2 and max(steps["forwards"]) == 1
