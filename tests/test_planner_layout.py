"""The planner lays a rank out with the runtime's own functions: its exact estimate of a mixture of experts under expert
and tensor parallelism (E / ep experts a rank, their widths split over tp, expert weights sharded over dp alone) equals
what the engine holds, to the byte, at every ZeRO stage; the closed form carries ep and offload; one FLOP count.
The tp=2 case of the engine comparison is `pytest -m slow tests/test_planner_layout.py`."""

from __future__ import annotations

import pytest

from behemoth.cli.estimate import measure_worker
from behemoth.config import Config, load_config
from behemoth.planner.cluster import load_cluster
from behemoth.planner.cost import price
from behemoth.planner.layout import Layout, Offload, Workload
from behemoth.planner.memory import estimate
from tests.common import tiny_config
from tests.dist import run_ranks

MOE = ("model=gpt-moe-tiny", "parallel.bucket_mb=0.01")  # 2 MoE blocks of 4 experts; several buckets per sync


@pytest.mark.parametrize("plan", [("parallel.ep=2",), pytest.param(("parallel.tp=2",), marks=pytest.mark.slow)])
def test_exact_estimate_of_experts_equals_the_engine(plan, tmp_path):
    """On 2 processes: ep=2 (each rank 2 of 4 experts; dense parameters over dp x ep, experts over dp) and tp=2 (every
    expert's width split); stages 0-3 built by the engine and counted, against the planner's meta layout."""
    cfg = tiny_config(tmp_path, *MOE, *plan)
    ranks = run_ranks(2, measure_worker, cfg, [0, 1, 2, 3])
    config = Config.model_validate(cfg)
    for rank, results in enumerate(ranks):
        data_rank = rank if "parallel.ep=2" in plan else 0
        for got in results:
            stage = got["stage"]
            exact = estimate(config, world=2, stages=(stage,), rank=data_rank)[0]
            expected = {**{part: getattr(exact, part) for part in ("params", "grads", "optimizer")}, **exact.buffers}
            for part, size in expected.items():
                assert got["bytes"][part] == size, f"{plan} stage {stage} rank {rank} {part}: {got['bytes'][part]} != {size}"


def test_expert_parallelism_divides_the_experts_states():
    """A rank of ep=2 holds half of every expert (dense parameters whole), at ZeRO-0: what the closed form says too."""
    base = ["model=gpt-moe-tiny", "train.global_batch=8", "train.seq_len=32"]
    one, two = (load_config(None, base + [f"parallel.ep={ep}"]) for ep in (1, 2))
    work = Workload.of(one)
    share = work.census.at(1, 2)
    assert share.experts > 0 and work.census.at(1, 1).experts == 2 * share.experts
    whole, half = (estimate(c, world=ep, stages=(0,))[0] for c, ep in ((one, 1), (two, 2)))
    assert whole.psi - half.psi == work.census.shape.n_layer * share.experts
    closed = price(work, Layout.of_config(two, 2), load_cluster("a100-80gb")).memory[0]
    assert closed.states == pytest.approx(half.states, rel=1e-12)
    assert Layout.of_config(two, 2).world == 2 and Layout.of_config(two, 2).describe().startswith("dp=1 ep=2")


@pytest.mark.parametrize("opts,world", [(("parallel.ep=2", "parallel.dp=2"), 4), (("parallel.ep=2", "parallel.tp=2"), 4)])
def test_closed_form_of_experts_equals_the_exact_layout(opts, world):
    """The search's closed form (a one-block census, dense parameters over dp x ep, experts over dp) against the meta
    layout of the whole model at every ZeRO stage (an expert count over dp x ep, or experts kept whole, would differ)."""
    for zero in (0, 1, 2, 3):
        cfg = load_config(
            None, ["model=gpt-moe-tiny", "train.global_batch=8", "train.seq_len=32", "parallel.bucket_mb=1000", f"parallel.zero_stage={zero}", *opts]
        )
        exact = estimate(cfg, world=world, stages=(zero,))[0]
        closed = price(Workload.of(cfg), Layout.of_config(cfg, world), load_cluster("a100-80gb")).memory[0]
        assert closed.states == pytest.approx(exact.states, rel=1e-12), (zero, closed.states, exact.states)


def test_offloaded_states_leave_the_device():
    """With every state on disk the device holds only its streamed units; the states are counted on disk, and the
    step pays for the bytes the disk moves."""
    cfg = load_config(None, ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", "parallel.zero_stage=3"])
    work, cluster = Workload.of(cfg), load_cluster("a100-80gb")
    lay = Layout.of_config(cfg, 2)
    disk = lay.but(offload=Offload("disk", "disk", "disk"))
    plain, off = price(work, lay, cluster).memory[0], price(work, disk, cluster)
    assert off.memory[0].states == 0 and off.memory[0].disk == pytest.approx(plain.states)
    assert off.time.offload_io > 0 and "off[p=disk g=disk o=disk]" in disk.describe()
    assert disk.to_plan(cfg.parallel).zero_stage == 3 and Offload.of(cfg) == Offload()


def test_one_flop_count():
    """The census, the model and the pipeline balancer read one count (models/shape.py): a block's forward FLOPs are
    a third of its training FLOPs' attention-and-matrix part."""
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.shape import block_forward_flops, layer_flops

    cfg = load_config(None, ["model=gpt-1m"])
    lm, census = build_causal_lm(cfg.model), Workload.of(cfg).census
    assert census.flops_per_token(64) == lm.flops_per_token(64)
    assert layer_flops(lm.shape, 64).blocks[0] == block_forward_flops(lm.shape, 64)
    assert lm.hardware_flops_per_token(64, 2) == lm.flops_per_token(64) + 2 * block_forward_flops(lm.shape, 64)
