"""CPU processes pay for their pipeline messages in CPU: each message a pass sends or receives costs the rank
`HostSpec.message_cpu_us` in line with its passes (measured by `behemoth calibrate` between computations, as a stage
sends), so a schedule that crosses ranks more often (interleaved) is charged for every crossing, and stages that hand
their activations over on one rank (V-shaped schedules) are not."""

from __future__ import annotations

import math

import pytest
import torch

from behemoth.config import load_config
from behemoth.planner.calibrate import spec_from
from behemoth.planner.cluster import load_cluster
from behemoth.planner.cost import price, resolve_bounds
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.pingpong import message_cpu
from behemoth.planner.steptime import pass_costs
from tests.dist import run_ranks
from tests.test_plan_cli import measured_here

MESSAGE_US = 300.0


def cluster(world: int, message_us: float):
    return spec_from(measured_here(0.0) | {"world": world, "cores": world, "message_cpu_us": message_us})


def work() -> Workload:
    return Workload.of(load_config(None, ["model=gpt-1m", "model.n_layer=8", "train.global_batch=16", "train.seq_len=128"]))


@pytest.mark.parametrize(
    "lay, ends",
    [
        (Layout(pp=4, micro_batch=2, microbatches=8, schedule="1f1b"), [1, 2, 2, 1]),  # the ends receive or send, the middle both
        (Layout(pp=2, micro_batch=2, microbatches=8, schedule="interleaved", chunks=2), [1, 2, 2, 1]),  # 0 1 0 1: every boundary crosses
        (Layout(pp=2, micro_batch=2, microbatches=8, schedule="zbv", chunks=2), [1, 1, 1, 1]),  # 0 1 1 0: stages 1 and 2 share rank 1
        (Layout(pp=2, micro_batch=2, microbatches=8, schedule="chimera"), [1, 1]),  # each pipeline's two stages on two ranks
    ],
    ids=["1f1b", "interleaved", "zbv", "chimera"],
)
def test_each_pass_pays_the_messages_it_sends_or_receives(lay, ends):
    w = work()
    bounds = resolve_bounds(w, lay)
    paid, free = pass_costs(w, lay, cluster(lay.pp, MESSAGE_US), bounds), pass_costs(w, lay, cluster(lay.pp, 0.0), bounds)
    charge = [e * MESSAGE_US * 1e-6 for e in ends]
    assert [a - b for a, b in zip(paid.forward, free.forward)] == pytest.approx(charge)
    assert [a - b for a, b in zip(paid.backward, free.backward)] == pytest.approx(charge)
    assert paid.weight == free.weight  # a split weight pass sends nothing


def test_interleaving_gains_less_when_its_crossings_cost_cpu():
    """Interleaved 1F1B at p = 2 crosses ranks three times per micro-batch each way against 1F1B's once: priced, its
    step grows by more than 1F1B's, and by at least its extra message ends per rank (4 x 8 micro-batches x 2 passes,
    minus what the simulator can hide in the bubble: nothing here, every rank is busy)."""
    w = work()
    one = Layout(pp=2, micro_batch=2, microbatches=8, schedule="1f1b")
    inter = Layout(pp=2, micro_batch=2, microbatches=8, schedule="interleaved", chunks=2)
    grow = {lay.schedule: price(w, lay, cluster(2, MESSAGE_US)).time.total - price(w, lay, cluster(2, 0.0)).time.total for lay in (one, inter)}
    assert grow["1f1b"] >= 2 * 8 * MESSAGE_US * 1e-6 * 0.99  # rank 0: one receive or send per pass, 16 passes
    assert grow["interleaved"] >= grow["1f1b"] + 2 * 8 * 2 * MESSAGE_US * 1e-6 * 0.99  # rank 0's chunk 2 sends and receives both ways


def test_gpus_and_old_cluster_files_pay_nothing():
    assert load_cluster("a100-80gb").message_cpu_seconds == 0.0
    assert spec_from(measured_here(0.0)).message_cpu_seconds == 0.0  # a calibration from before the measurement
    assert cluster(2, MESSAGE_US).message_cpu_seconds == pytest.approx(MESSAGE_US * 1e-6)


def measure_rank() -> float:
    from behemoth.topology import init_runtime

    rt = init_runtime(timeout_s=60.0)
    try:
        assert message_cpu(torch.device("cuda"), rt.world_group) == 0.0  # a GPU's transfers are the device's: not measured
        return message_cpu(torch.device("cpu"), rt.world_group, exchanges=40, rounds=2)
    finally:
        rt.close()


def test_the_measurement_is_agreed_by_every_rank():
    """Ranks 0 and 1 exchange between products while rank 2 idles; all three report the same finite figure (the CPU's
    cost itself, tens to hundreds of microseconds here, is the calibration's number, not asserted). A GPU's is not
    measured."""
    got = run_ranks(3, measure_rank, timeout=120)
    assert len(set(got)) == 1 and math.isfinite(got[0]) and 0.0 <= got[0] < 1e5, got


@pytest.mark.parametrize("zero, messages", [(0, 4), (3, 6 * (2 + 2 + 2))])  # one bucket's all-reduce; per block: two gathers, a scatter
def test_data_parallel_collectives_pay_their_messages_cpu_which_nothing_hides(zero, messages):
    """dp = 2 on the 6-block model, one micro-batch: a ring collective over 2 ranks sends and receives one message each
    way per step (an all-reduce two): ZeRO-0's single bucket costs 4 message ends, ZeRO-3's 6 units 6 ends each, and the
    charge is exposed whatever share of the traffic hides (here: all the compute could hide)."""
    from behemoth.planner.comm import data_parallel_time

    w = Workload.of(
        load_config(None, ["model=gpt-1m", "model.n_layer=6", "model.d_model=256", "model.n_head=8", "train.global_batch=16", "train.seq_len=128"])
    )
    lay = Layout(dp=2, zero=zero, micro_batch=8, microbatches=1)
    paid, free = (
        c.model_copy(update={"device": c.device.model_copy(update={"comm_overlap": 1.0})}) for c in (cluster(2, MESSAGE_US), cluster(2, 0.0))
    )
    elements = 2e6  # 8 MB of float32 gradients: one all-reduce bucket
    assert 4 * elements <= w.bucket_mb * 2**20
    a, b = (data_parallel_time(w, lay, c, elements, forward=1.0, backward=2.0) for c in (paid, free))
    assert a.cpu == pytest.approx(messages * MESSAGE_US * 1e-6) and b.cpu == 0.0
    assert a.exposed - b.exposed == pytest.approx(a.cpu) and a.traffic == b.traffic


@pytest.mark.parametrize(
    "lay, forward, backward",
    [
        # 1-D tp = 2: two all-reduces a pass (attention's output, the MLP's), 4 message ends each (a ring's two steps
        # each way); with sp an all-gather and a reduce-scatter in their place, 2 ends each
        (Layout(tp=2, micro_batch=2, microbatches=8), 2 * 4, 2 * 4),
        (Layout(tp=2, sp=True, micro_batch=2, microbatches=8), 2 * (2 + 2), 2 * (2 + 2)),
        # the ring over cp = 2: forward one K/V hop (a send and a receive); backward the K/V hop, the gradient's hop
        # and the gradient's return
        (Layout(cp=2, cp_mode="ring", micro_batch=2, microbatches=8), 2, 3 * 2),
        # Ulysses over cp = 4: four all-to-alls each way, each a send and a receive with 3 others
        (Layout(cp=4, cp_mode="ulysses", micro_batch=2, microbatches=8), 4 * 2 * 3, 4 * 2 * 3),
    ],
    ids=["tp", "tp-sp", "cp-ring", "cp-ulysses"],
)
def test_in_line_collectives_of_a_block_pay_their_messages_cpu(lay, forward, backward):
    """Tensor and context parallelism's collectives run in line with a block's passes: each of their messages costs
    the rank `message_cpu_us` on top of the transfer, as a pipeline's do."""
    from behemoth.planner.compute import price_block

    w = work()
    world = lay.tp * lay.cp
    paid, free = price_block(w, lay, cluster(world, MESSAGE_US)), price_block(w, lay, cluster(world, 0.0))
    per_pass = lambda c: (c.forward + c.comm, c.input_grad + c.comm)  # noqa: E731  (comm: each pass's tp collectives)
    (pf, pb), (ff, fb) = per_pass(paid), per_pass(free)
    assert pf - ff == pytest.approx(forward * MESSAGE_US * 1e-6)
    assert pb - fb == pytest.approx(backward * MESSAGE_US * 1e-6)
    assert paid.weight_grad == free.weight_grad


def test_expert_all_to_alls_pay_their_messages_cpu():
    """ep = 2: each MoE block's dispatch and combine, forward and backward, per micro-batch, a send and a receive."""
    from behemoth.planner.comm import expert_seconds

    w = Workload.of(load_config(None, ["model=gpt-moe-tiny", "train.global_batch=16", "train.seq_len=32"]))
    lay = Layout(dp=2, ep=2, micro_batch=2, microbatches=4)
    moe_blocks = sum(1 for e in w.census.shape.experts if e)
    assert moe_blocks > 0
    extra = expert_seconds(w, lay, cluster(2, MESSAGE_US)) - expert_seconds(w, lay, cluster(2, 0.0))
    assert extra == pytest.approx(4 * 4 * moe_blocks * 2 * MESSAGE_US * 1e-6)
