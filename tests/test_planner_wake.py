"""Ranks that outnumber their cores: a point-to-point message costs the woken rank's wait for a core (`HostSpec.wake_us`,
measured by `behemoth calibrate`), priced on every pipeline message and ring hop the rank waits for, and kept at full
size on the critical path when idle ranks lend their cores to the busy ones."""

from __future__ import annotations

import pytest
import torch

from behemoth.config import load_config
from behemoth.planner.attention import context_comm_seconds
from behemoth.planner.calibrate import spec_from
from behemoth.planner.cost import price
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.messages import pipeline_message_seconds
from behemoth.planner.pingpong import wake_latency
from tests.dist import run_ranks
from tests.test_plan_cli import measured_here

WAKE_US = 500.0


def measured(world: int, cores: int, wake_us: float) -> dict:
    """Rank 0's measurements as `calibrate_worker` returns them for `world` CPU processes on `cores` cores."""
    return measured_here(0.0) | {"world": world, "cores": cores, "wake_us": wake_us, "comm_overlap": 0.0}


def work() -> Workload:
    return Workload.of(load_config(None, ["model=gpt-1m", "train.global_batch=16", "train.seq_len=128"]))


@pytest.mark.parametrize("cores, charged", [(2, True), (4, False)])
def test_messages_and_ring_hops_pay_the_wake_only_where_ranks_share_cores(cores, charged):
    """Each pipeline message and each ring hop a rank waits for costs wake_us more on 4 processes of 2 cores; on 4 cores the
    measured figure is not charged."""
    woken, idle = spec_from(measured(4, cores, WAKE_US)), spec_from(measured(4, cores, 0.0))
    assert woken.host.wake_us == WAKE_US and woken.wake_seconds == (WAKE_US * 1e-6 if charged else 0.0)
    wake = WAKE_US * 1e-6 if charged else 0.0
    pipeline = Layout(pp=4, micro_batch=2, microbatches=8, schedule="1f1b")
    assert pipeline_message_seconds(work(), pipeline, woken) - pipeline_message_seconds(work(), pipeline, idle) == pytest.approx(wake)
    ring = Layout(cp=4, micro_batch=2, microbatches=8)  # forward: 3 hops waited for; backward: one wait per step, and the last gradient
    (fw, bw), (fi, bi) = context_comm_seconds(work(), ring, woken), context_comm_seconds(work(), ring, idle)
    assert (fw - fi, bw - bi) == pytest.approx((3 * wake, 5 * wake))


def test_the_critical_path_keeps_message_latency_whole_when_idle_ranks_lend_their_cores():
    """4 stages on 2 cores: the passes of the critical path run twice as fast when the other ranks idle, its messages do
    not. With a wake long enough for the critical path to set the step, the step grows by at least the 2(p - 1) hops of
    the first micro-batch's way down and back, each by the whole wake (halving it, as the passes are, gives half)."""
    wake_us = 20_000.0
    woken, idle = spec_from(measured(4, 2, wake_us)), spec_from(measured(4, 2, 0.0))
    lay = Layout(pp=4, micro_batch=2, microbatches=8, schedule="1f1b")
    slow, fast = price(work(), lay, woken, exact=True).time, price(work(), lay, idle, exact=True).time
    assert slow.total - fast.total >= 2 * (lay.pp - 1) * wake_us * 1e-6
    assert slow.bubble > fast.bubble  # the waits are idle time of the pipeline


def wake_rank(cores: int | None) -> float:
    from behemoth.topology import init_runtime

    rt = init_runtime(timeout_s=60.0)
    try:
        return wake_latency(torch.device("cpu"), rt.world_group, nbytes=2**12, seconds=0.3, cores=cores)
    finally:
        rt.close()


def test_wake_latency_is_measured_by_every_rank_together_and_agreed():
    """Three processes counted as sharing one core: ranks 0 and 1 ping-pong (the last trip flagged in the message, so
    neither waits for a trip the other skips) while rank 2 idles and then multiplies; every rank reports the same
    figure. Three processes with a core each: nothing to measure, 0."""
    shared = run_ranks(3, wake_rank, 1, timeout=120)
    assert len(set(shared)) == 1 and 0.0 <= shared[0] < 1e6, shared
    assert run_ranks(3, wake_rank, 3, timeout=120) == [0.0, 0.0, 0.0]
