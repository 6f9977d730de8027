"""Offload under a pipeline: each stage streams its own units in its schedule's order (offload/stage_stream.py).

tests/test_composition.py trains pp=2 x offload host / disk under gpipe, 1f1b, interleaved and zb-h1 at 4 micro-batches
against the single-process curve (losses and final weights). Here: other micro-batch counts and both step modes against
the single-process losses, the bytes each stage moves per step against what its unit visits plan (offload/stage_order.py;
zb-h1's split backward too), a stage that sends a wrong gradient and a W that adds no weight gradient missing the curve
(the controls), zbv, dualpipev and 1f1b-scp against the single-process curve, and a checkpoint of a pipelined offloaded
run resuming on the same curve, streamed again or in memory on one process; a tied embedding (its two copies' gradients
summed; not summed: the control) and experts (inside their blocks' units, or over ep in units of their own; their
gradients zeroed: the control) against the single-process curve. A LoRA base: tests/test_lora_offload.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

# (schedule, micro-batches, offload.step): the deferred step clips (train.grad_clip=1), the fused one does not
VARIANTS = [("gpipe", 4, "deferred"), ("1f1b", 3, "fused"), ("zb-h1", 4, "fused")]
DISK = ["offload.params=disk", "offload.optimizer=disk"]


def _engine_steps(run_dir: str, m: int, overrides: list[str], bug: str = "") -> dict[str, Any]:
    """Three steps of m micro-batches of one sequence through the engine; losses, and the last step's bytes per kind of
    state as counted by the tiers and as this rank's unit visits plan them (pipelined runs)."""
    import torch

    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.offload.budget import unit_sizes
    from behemoth.offload.order import StateSizes, plan_residencies, swap_bytes
    from behemoth.offload.stage_order import stage_order
    from behemoth.offload.stage_stream import StageStreams
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(tiny_config(run_dir, f"train.global_batch={m}", "train.micro_batch=1", "model.n_layer=4", *overrides))
    rt = init_runtime(timeout_s=60, **cfg.parallel.degrees())
    engine = build_engine(cfg, rt)
    stages = engine.model.executor
    if bug == "weight":  # the control of a split backward: a block's W recomputes nothing, so its weights never learn
        from behemoth.offload.executor import BoundaryPass

        def no_weights(self: BoundaryPass, a: Any, autocast: Any) -> None:
            self.weight_grads.pop((a.unit, a.mb)), self.rng.pop((a.unit, a.mb)), self.hidden.pop((a.unit - 1, a.mb))

        BoundaryPass.backward_weight = no_weights  # type: ignore[method-assign]  # this process only
    if bug == "grad":  # the control: a later stage sends back no gradient (zeros), so the earlier stage's units never learn
        end_pass = StageStreams.end_pass

        def dropped(self: StageStreams, kind: str, stage: int, mb: int, step: Any, state: Any) -> None:
            end_pass(self, kind, stage, mb, step, state)
            if kind == "B" and stage > 0:
                step.mailbox[("grad", stage, mb)].zero_()

        stages.end_pass = dropped.__get__(stages)
    tokens = torch.randint(0, 256, (m, 33), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(m)]
    out: dict[str, Any] = {"losses": [engine.train_step(batch, lr=3e-3).loss for _ in range(3)]}
    if isinstance(stages, StageStreams):
        sync = engine.model.syncs[0]
        stores = stages.streamer.stores  # by order.py's unit number
        sizes = [StateSizes(0, 0, 0)] * (stages.pipeline.bounds[-1] + 2)
        for unit, size in zip(stores, unit_sizes([s.layout for s in stores.values()], 0, 32)):
            sizes[unit] = StateSizes(4 * size.shard, 4 * size.shard, size.state_bytes)
        plan = plan_residencies(stage_order(stages.schedule, stages.rank, stages.units), {})
        out["counted"] = {k: list(v) for k, v in sync.step_bytes().items()}
        out["planned"] = {k: list(v) for k, v in swap_bytes(plan, sizes, deferred=not sync.policy.fused).items()}
    engine.close()
    rt.close()
    return out


def _variants_body(tmp: str, pipelined: bool) -> list[dict[str, Any]]:
    out = []
    for i, (schedule, m, step) in enumerate(VARIANTS):
        clip = "train.grad_clip=1" if step == "deferred" else "train.grad_clip=0"
        piped = ["parallel.pp=2", f"parallel.schedule={schedule}", *DISK, f"offload.step={step}"] if pipelined else []
        out.append(_engine_steps(f"{tmp}/{i}", m, [clip, *piped]))
    if pipelined:
        out.append(_engine_steps(f"{tmp}/bug", 4, ["parallel.pp=2", "parallel.schedule=gpipe", *DISK], bug="grad"))
        split = ["train.grad_clip=0", "parallel.pp=2", "parallel.schedule=zb-h1", *DISK, "offload.step=fused"]  # as its variant
        out.append(_engine_steps(f"{tmp}/no-w", 4, split, bug="weight"))
    return out


def test_stage_streams_follow_the_curve_and_move_what_their_visits_plan(tmp_path):
    """Every variant's losses within 1e-5 of one process in memory (zb-h1: each block's input- and weight-gradient passes
    recompute it, its gradient reduced and stepped after its last W); on every rank the last step's bytes per kind of
    state equal its plan's; a stage that sends no gradient, or a W that adds no weight gradient, moves the loss beyond
    10x that tolerance (the controls)."""
    refs = run_ranks(1, _variants_body, str(tmp_path / "ref"), False, timeout=120)[0]
    ranks = run_ranks(2, _variants_body, str(tmp_path / "pp"), True, timeout=240)
    for v, ref in enumerate(refs):
        for r, got in enumerate(ranks):
            assert got[v]["counted"] == got[v]["planned"], (VARIANTS[v], r, got[v]["counted"], got[v]["planned"])
        losses = ranks[1][v]["losses"]  # the last stage's (the engine reduces the loss over the pipeline: every rank's)
        assert all(abs(a - b) <= 1e-5 * a for a, b in zip(ref["losses"], losses)), (VARIANTS[v], ref["losses"], losses)
    for bug, ref in ((ranks[0][-2]["losses"], refs[0]["losses"]), (ranks[0][-1]["losses"], refs[2]["losses"])):  # zb-h1's: as its variant's
        assert abs(bug[-1] - ref[-1]) > 1e-4 * ref[-1], (bug, ref)


@pytest.mark.slow
def test_checkpoint_of_a_streamed_pipeline_resumes_streamed_and_in_memory(tmp_path):
    """6 steps of pp=2 from disk (1f1b, 4 micro-batches) with a checkpoint at step 3; resumed from it under the same layout
    and on one process in memory, both continue its curve (losses and final weights)."""
    piped = ["parallel.pp=2", "parallel.schedule=1f1b", "parallel.microbatches=4", *DISK]
    base = ["train.steps=6", "train.eval_every=0", "checkpoint.every=3", "checkpoint.async_save=false", "model.n_layer=4"]
    full = run_ranks(2, train_body, tiny_config(tmp_path / "full", *base, *piped), timeout=180)[0]
    ckpt = str(tmp_path / "full" / "checkpoints" / "step_0000003")
    for name, world, layout in (("streamed", 2, piped), ("in-memory", 1, [])):
        resumed = run_ranks(world, train_body, tiny_config(tmp_path / name, *base, *layout), ckpt, timeout=180)[0]
        assert resumed["start"] == 3, name
        assert_close_runs({"losses": full["losses"][3:], "weights": full["weights"]}, resumed)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.tp=2", "parallel.sequence_parallel=false"],
        ["parallel.dp=2"],
        ["parallel.dp=2", "parallel.schedule=zb-h1"],  # each W's gradient reduce-scattered over dp after its last W
    ],
)
def test_streamed_pipeline_under_tensor_or_data_parallelism_trains_the_curve(tmp_path, extra):
    """pp=2 x tp=2 (with and without sequence parallelism) or x dp=2, units from disk: each tp rank streams its part of
    its stage's units, each dp rank its 1/dp shard of them (all-gathered per visit, gradients reduce-scattered)."""
    from tests.test_composition import BASE, CORPUS, reference_config, train_plans

    ref = run_ranks(1, train_plans, [reference_config(False, tmp_path / "ref")], timeout=120)[0][0]
    options = ["parallel.pp=2", *extra, "parallel.microbatches=4", *DISK]
    cfg = tiny_config(tmp_path / "pp-x", f"data.path={CORPUS}", *BASE, *options)
    assert_close_runs(ref, run_ranks(4, train_plans, [cfg], timeout=300)[0][0])


@pytest.mark.parametrize("zero", [0, 3])
def test_a_streamed_pipeline_passes_the_feasibility_check_at_zero_stage_0_and_3(zero):
    """Streamed units are ZeRO-3's at either stage (offload's docs: 0 and 3 mean the same here), so ZeRO-3's refusal
    under a pipeline (each pass would gather the stage again) is not offload's; a tied head, a LoRA base and experts
    (over ep too) pass as well."""
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    options = ["model=gpt-tiny", "parallel.pp=2", "parallel.microbatches=4", f"parallel.zero_stage={zero}", *DISK]
    for extra, world in (
        ([], 2),
        (["model.tie_embeddings=true"], 2),
        (["finetune.lora.enabled=true"], 2),
        (["model=gpt-moe-tiny", "parallel.ep=2"], 4),
    ):
        assert problems(load_config(None, [*options, *extra]), world) == [], extra


# (schedule, tier): V-shaped (two stages per rank, the first and the last on rank 0, split backwards; DualPipeV mixes in
# full ones) and Merak's shifted critical path (its RECOMPUTE passes empty for a streamed stage)
STREAMED_SCHEDULES = [("zbv", "host"), ("dualpipev", "host"), ("1f1b-scp", "disk")]


def test_v_shaped_and_scp_schedules_stream_the_single_process_curve(tmp_path):
    """pp=2 under zbv, dualpipev and 1f1b-scp, 4 micro-batches, units on host memory or disk, trained in one set of two
    processes: losses within 1e-5 and final weights within 1e-4 of one process in memory."""
    from tests.test_composition import BASE, CORPUS, reference_config, train_plans

    ref = run_ranks(1, train_plans, [reference_config(False, tmp_path / "ref")], timeout=120)[0][0]
    cfgs = [
        tiny_config(
            tmp_path / name,
            f"data.path={CORPUS}",
            *BASE,
            "parallel.pp=2",
            f"parallel.schedule={name}",
            "parallel.microbatches=4",
            f"offload.params={tier}",
            f"offload.optimizer={tier}",
        )
        for name, tier in STREAMED_SCHEDULES
    ]
    for (name, tier), got in zip(STREAMED_SCHEDULES, run_ranks(2, train_plans, cfgs, timeout=300)[0]):
        try:
            assert_close_runs(ref, got)
        except AssertionError as err:
            raise AssertionError(f"{name} x offload {tier}: {err}") from None


TIED = ["model.tie_embeddings=true"]


def _tied_plans(cfgs: list[dict[str, Any]], control: dict[str, Any]) -> list[dict[str, Any]]:
    """`train_plans` of `cfgs`, then of `control` with the two copies of the tied embedding's gradient never summed (each
    stage steps its own copy with its own part of the gradient)."""
    from behemoth.offload import stage_tied
    from tests.test_composition import train_plans

    out = train_plans(cfgs)
    stage_tied.pair_all_reduce = lambda *args, **kwargs: None  # type: ignore[assignment]  # this process only
    return out + train_plans([control])


def test_a_tied_embedding_streamed_by_two_stages_trains_the_single_process_curve(tmp_path):
    """A GPT-2-like tied head, pp=2: the first stage's embedding unit and the last stage's copy of it (read by the head)
    each hold their gradient to the end of the step's passes, sum the two shards and take the same step (deferred with
    clipping under 1f1b from host memory, fused without under zb-h1 from disk): losses within 1e-5 and final weights
    within 1e-4 of one process in memory; the copies stepped apart (gradients not summed) miss the curve (the control)."""
    from tests.test_composition import BASE, CORPUS, train_plans

    def cfg(name: str, *options: str) -> dict[str, Any]:
        return tiny_config(tmp_path / name, f"data.path={CORPUS}", *BASE, *TIED, *options)

    fused = ["train.grad_clip=0", "offload.step=fused"]
    refs = run_ranks(1, train_plans, [cfg("ref"), cfg("ref-fused", *fused)], timeout=120)[0]
    piped = ["parallel.pp=2", "parallel.microbatches=4"]
    host = [*piped, "parallel.schedule=1f1b", "offload.params=host", "offload.optimizer=host"]
    disk = [*piped, "parallel.schedule=zb-h1", *DISK, *fused]
    got = run_ranks(2, _tied_plans, [cfg("host", *host), cfg("disk", *disk)], cfg("control", *host), timeout=300)[0]
    assert_close_runs(refs[0], got[0])
    assert_close_runs(refs[1], got[1])
    with pytest.raises(AssertionError):
        assert_close_runs(refs[0], got[2])


@pytest.mark.slow
def test_a_tied_embedding_streamed_under_data_parallelism_trains_the_curve(tmp_path):
    """pp=2 x dp=2, units from disk: both copies of the tied embedding are cut into the same 1/dp shards, so each dp
    rank sums its shard with its pipeline peer's: the single-process curve (4 processes)."""
    from tests.test_composition import BASE, CORPUS, train_plans

    ref = run_ranks(1, train_plans, [tiny_config(tmp_path / "ref", f"data.path={CORPUS}", *BASE, *TIED)], timeout=120)[0][0]
    options = ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4", *DISK]
    got = run_ranks(4, train_plans, [tiny_config(tmp_path / "pp-dp", f"data.path={CORPUS}", *BASE, *TIED, *options)], timeout=300)[0][0]
    assert_close_runs(ref, got)


def _expert_plans(cfgs: list[dict[str, Any]], control: dict[str, Any]) -> list[dict[str, Any]]:
    """`train_plans` of `cfgs`, then of `control` with every expert unit's complete gradient zeroed before its step."""
    from behemoth.offload.stepper import UnitSteps
    from tests.test_composition import train_plans

    out = train_plans(cfgs)
    complete = UnitSteps.gradient_complete

    def no_expert_grads(self: UnitSteps, store: Any, shard: Any, grad: Any, **kwargs: Any) -> None:
        complete(self, store, shard, grad.zero_() if store.spec.group is not None else grad, **kwargs)

    UnitSteps.gradient_complete = no_expert_grads  # type: ignore[method-assign]  # this process only
    return out + train_plans([control])


def test_experts_streamed_by_pipeline_stages_train_the_single_process_curve(tmp_path):
    """An MoE model (4 experts per block, top-2), pp=2, units in host memory, experts inside their blocks' units (ep=1):
    losses within 1e-5 and final weights within 1e-4 of one process in memory."""
    from tests.test_composition import BASE, CORPUS, MOE, reference_config, train_plans

    ref = run_ranks(1, train_plans, [reference_config(True, tmp_path / "ref")], timeout=120)[0][0]
    options = ["parallel.pp=2", "parallel.microbatches=4", "offload.params=host", "offload.optimizer=host"]
    got = run_ranks(2, train_plans, [tiny_config(tmp_path / "pp", f"data.path={CORPUS}", *BASE, *MOE, *options)], timeout=300)[0][0]
    assert_close_runs(ref, got)


@pytest.mark.slow
def test_expert_units_over_ep_streamed_by_pipeline_stages_train_the_curve(tmp_path):
    """pp=2 x ep=2 from disk (4 processes): each block's experts are a unit of their own over the experts' group, read
    by the block's visits on its stage: the single-process curve; their gradients zeroed, the experts miss it (the
    control)."""
    from tests.test_composition import BASE, CORPUS, MOE, reference_config, train_plans

    ref = run_ranks(1, train_plans, [reference_config(True, tmp_path / "ref")], timeout=120)[0][0]
    options = ["parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4", *DISK]

    def cfg(name: str) -> dict[str, Any]:
        return tiny_config(tmp_path / name, f"data.path={CORPUS}", *BASE, *MOE, *options)

    got = run_ranks(4, _expert_plans, [cfg("pp-ep")], cfg("control"), timeout=400)[0]
    assert_close_runs(ref, got[0])
    with pytest.raises(AssertionError):
        assert_close_runs(ref, got[1])
