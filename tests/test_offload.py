"""Offloaded training equals in-memory training (float32, gradient accumulation and clipping on), on 1 and 2
processes, for parameters, optimizer state and both on disk; Harmony's order equals the naive one and its bytes
per step do not grow with the micro-batches; checkpoints move between offloaded and in-memory layouts; 8-bit
moments follow float32 AdamW within a stated tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

ACCUMULATE = {1: "train.micro_batch=4", 2: "train.micro_batch=2"}  # 2 micro-batches per rank
PLACEMENTS = {
    "params": ["offload.params=disk", "offload.grads=none"],
    "optimizer": ["offload.optimizer=disk"],
    "all": ["offload.params=disk", "offload.optimizer=disk"],  # gradients follow the parameters (offload.grads=auto)
}


def _grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "grad_norm" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """In memory, one process, 8 sequences per step in 2 micro-batches, clipping at 1.0."""
    run_dir = tmp_path_factory.mktemp("ref")
    result = run_ranks(1, train_body, tiny_config(run_dir, ACCUMULATE[1]))[0]
    result["grad_norms"] = _grad_norms(run_dir)
    return result


def test_reference_clips_every_step(reference):
    assert min(reference["grad_norms"]) > 1.0, "clipping must be active for the comparison to test it"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_disk_offload_matches_in_memory_training(placement, world, reference, tmp_path):
    """Losses every step and final weights (read back from the DCP checkpoint the run saves) equal in-memory training's;
    the scratch directory is gone at the end."""
    got = run_ranks(world, train_body, tiny_config(tmp_path, ACCUMULATE[world], *PLACEMENTS[placement]))
    assert_close_runs(reference, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"
    norms = _grad_norms(tmp_path)
    assert all(abs(a - b) <= 1e-4 * a for a, b in zip(reference["grad_norms"], norms)), "the clipped norm is the in-memory one"
    assert not (tmp_path / "offload-scratch").exists(), "the scratch directory is removed when the run ends"


def test_an_unclipped_deferred_step_would_be_caught(reference, tmp_path):
    """The same run with the clipping coefficient dropped from the deferred step: far outside the tolerance."""
    got = run_ranks(1, _train_ignoring_clip, tiny_config(tmp_path, ACCUMULATE[1], *PLACEMENTS["all"]))[0]
    with pytest.raises(AssertionError):
        assert_close_runs(reference, got)


def _train_ignoring_clip(cfg_dict):
    from behemoth.offload.runtime import OffloadSync

    clip = OffloadSync.clip_held_grads

    def unclipped(self, coef, max_norm):
        clip(self, coef, max_norm)
        self.coef = 1.0

    OffloadSync.clip_held_grads = unclipped
    return train_body(cfg_dict)


def test_fused_step_matches_in_memory_training_without_clipping(tmp_path):
    """train.grad_clip=0: each unit steps on an I/O thread as soon as its gradient is complete; no gradient is stored."""
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", ACCUMULATE[1], "train.grad_clip=0"))[0]
    got = run_ranks(2, train_body, tiny_config(tmp_path / "off", ACCUMULATE[2], "train.grad_clip=0", *PLACEMENTS["all"]))[0]
    assert_close_runs(ref, got)
    rows = [r for r in map(json.loads, (tmp_path / "off" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert all(r["offload_written_mb_grads_disk"] == 0 and r["offload_read_mb_params_disk"] > 0 for r in rows)


@pytest.mark.parametrize(
    "world, extra",
    [
        (2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
        (2, ("model.tie_embeddings=true", "offload.order=naive", "offload.params=cpu")),
        (1, ("model=hf:llama", "hf.kv_heads=1")),
    ],
)
def test_offload_composes(world, extra, tmp_path):
    """With tensor and sequence parallelism; a tied head in the naive order with parameters on the host tier; a
    transformers Llama: the in-memory curve, offloaded."""
    if "model=hf:llama" in extra:
        pytest.importorskip("transformers")
    model = [e for e in extra if e.startswith(("model", "hf."))]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", ACCUMULATE[1], "train.steps=4", *model))[0]
    mb = "train.micro_batch=4" if "parallel.tp=2" in extra else ACCUMULATE[world]
    got = run_ranks(world, train_body, tiny_config(tmp_path / "off", mb, "train.steps=4", *PLACEMENTS["all"], *extra))[0]
    assert_close_runs(ref, got)


def test_harmony_equals_naive_and_only_naive_bytes_grow_with_microbatches():
    """Same losses for both orders; every step's counted bytes equal the residency plan's; Harmony's are the same for
    m = 1, 2, 4 micro-batches while naive's grow by the same amount with each micro-batch."""
    runs = {(order, m): r for order, m, r in run_ranks(1, _orders_body, [("harmony", m) for m in (1, 2, 4)] + [("naive", m) for m in (1, 2, 4)])[0]}
    for m in (1, 2, 4):
        for a, b in zip(runs["harmony", m]["losses"], runs["naive", m]["losses"]):
            assert abs(a - b) <= 1e-5 * a
    for key, r in runs.items():
        assert r["counted"] == r["expected"], (key, r["counted"], r["expected"])
    harmony = [runs["harmony", m]["total"] for m in (1, 2, 4)]
    naive = [runs["naive", m]["total"] for m in (1, 2, 4)]
    assert harmony[0] == harmony[1] == harmony[2] == naive[0]
    assert naive[1] - naive[0] > 0 and naive[2] - naive[0] == 3 * (naive[1] - naive[0])


def _orders_body(variants):
    """Three deferred steps on m micro-batches of one sequence per order; bytes of the last (steady) step, counted and planned."""
    import tempfile

    import torch

    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.offload.budget import unit_sizes
    from behemoth.offload.order import StateSizes, make_order, plan_residencies, swap_bytes
    from behemoth.topology import init_runtime

    out = []
    for order, m in variants:
        with tempfile.TemporaryDirectory() as run_dir:
            cfg = Config.model_validate(
                tiny_config(run_dir, f"train.global_batch={m}", "train.micro_batch=1", f"offload.order={order}", *PLACEMENTS["all"])
            )
            rt = init_runtime(timeout_s=60)
            engine = build_engine(cfg, rt)
            tokens = torch.randint(0, 256, (m, 33), generator=torch.Generator().manual_seed(0))
            batch = [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(m)]
            losses = [engine.train_step(batch, lr=1e-3).loss for _ in range(3)]
            sync = engine.model.syncs[0]
            counted = {k: list(v) for k, v in sync.step_bytes().items()}
            sizes = unit_sizes([s.layout for s in sync.stores], 0, 32)
            plan = plan_residencies(make_order(order, len(sync.stores) - 2, m), {})
            expected = swap_bytes(plan, [StateSizes(4 * u.shard, 4 * u.shard, u.state_bytes) for u in sizes], deferred=True)
            engine.close()
            rt.close()
            out.append(
                (
                    order,
                    m,
                    {
                        "losses": losses,
                        "counted": counted,
                        "expected": {k: list(v) for k, v in expected.items()},
                        "total": sum(r + w for r, w in counted.values()),
                    },
                )
            )
    return out


CKPT6 = "checkpoints/step_0000006"


@pytest.mark.parametrize("first, then", [((2, PLACEMENTS["all"]), (1, [])), ((1, []), (2, PLACEMENTS["params"] + ["offload.optimizer=cpu"]))])
def test_checkpoints_move_between_offloaded_and_in_memory_layouts(first, then, tmp_path):
    """Saved offloaded on 2 ranks and resumed in memory on 1, and the reverse: the resumed run continues the curve."""
    (w1, place1), (w2, place2) = first, then
    full = run_ranks(w1, train_body, tiny_config(tmp_path, ACCUMULATE[w1], "checkpoint.every=6", *place1))[0]
    resumed = run_ranks(w2, train_body, tiny_config(tmp_path, ACCUMULATE[w2], "checkpoint.every=6", *place2), str(tmp_path / CKPT6))[0]
    assert resumed["start"] == 6
    assert_close_runs({"losses": full["losses"][6:], "weights": full["weights"]}, resumed)


EIGHT_BIT_TOLERANCE = 0.01  # relative loss difference from float32 AdamW at every step of a 30-step curve


def test_8bit_moments_follow_float32_adamw_and_resume_on_another_layout(tmp_path):
    """30 steps with 8-bit blockwise moments stay within 1% of float32 AdamW's loss at every step and reach the same
    end within 1%; a checkpoint of the 8-bit run (moments saved as float32) resumes on 2 ranks within the same tolerance."""
    pytest.importorskip("bitsandbytes")
    steps = ["train.steps=30", "train.eval_every=0", "checkpoint.every=15"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "fp32", ACCUMULATE[1], *steps))[0]
    eight = run_ranks(1, train_body, tiny_config(tmp_path / "8bit", ACCUMULATE[1], *steps, "offload.optimizer=disk", "offload.optimizer_bits=8"))[0]
    gaps = [abs(a - b) / a for a, b in zip(ref["losses"], eight["losses"])]
    assert max(gaps) < EIGHT_BIT_TOLERANCE, max(gaps)
    assert max(gaps) > 0, "8-bit moments are not float32 ones: some difference must show"
    assert eight["losses"][-1] < 0.9 * eight["losses"][0], "the 8-bit run trains"
    resumed = run_ranks(
        2,
        train_body,
        tiny_config(tmp_path / "8bit", ACCUMULATE[2], *steps, "offload.optimizer=disk", "offload.params=disk", "offload.optimizer_bits=8"),
        str(tmp_path / "8bit" / "checkpoints/step_0000015"),
    )[0]
    assert resumed["start"] == 15
    assert max(abs(a - b) / a for a, b in zip(eight["losses"][15:], resumed["losses"])) < EIGHT_BIT_TOLERANCE


def test_a_crash_mid_step_leaves_the_last_checkpoint_and_a_scratch_that_is_never_reused(tmp_path):
    """A run dies in step 9, after two units took that step's update on disk: the step-6 checkpoint is whole, another
    run may not take the stale scratch, and resuming this run empties it and continues the uninterrupted curve."""
    from behemoth.config import Config
    from behemoth.offload.scratch import MARKER
    from behemoth.planner.feasibility import launch_problems

    place = ["checkpoint.every=6", *PLACEMENTS["all"]]
    full = run_ranks(1, train_body, tiny_config(tmp_path / "full", ACCUMULATE[1], *place))[0]
    cfg = tiny_config(tmp_path / "run", ACCUMULATE[1], *place)
    assert run_ranks(1, _die_in_step, cfg, 9)[0] == "died"
    scratch = tmp_path / "run" / "offload-scratch"
    assert (scratch / MARKER).exists() and (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    other = Config.model_validate(tiny_config(tmp_path / "other", ACCUMULATE[1], *place, f"offload.dir={scratch}"))
    assert any("stale scratch of another run" in p.message for p in launch_problems(other, 1, None))
    resumed = run_ranks(1, train_body, cfg, str(tmp_path / "run" / CKPT6))[0]
    assert_close_runs({"losses": full["losses"][6:], "weights": full["weights"]}, resumed)


def _die_in_step(cfg_dict, step):
    """Train until the third unit update of step `step`, then stop as a killed process would: no cleanup."""
    from behemoth.engine import Engine
    from behemoth.offload.store import UnitStore

    calls = {"steps": 0, "updates": 0}
    train_step, apply_step = Engine.train_step, UnitStore.apply_step

    def counting_step(self, *args, **kwargs):
        calls["steps"] += 1
        return train_step(self, *args, **kwargs)

    def dying_update(self, *args, **kwargs):
        if calls["steps"] == step:
            calls["updates"] += 1
            if calls["updates"] == 3:
                raise SystemExit("killed")
        return apply_step(self, *args, **kwargs)

    Engine.train_step, UnitStore.apply_step = counting_step, dying_update
    try:
        train_body(cfg_dict)
    except SystemExit:
        return "died"
    return "finished"


def test_streamed_logits_equal_the_in_memory_model(tmp_path):
    """The streamed forward (what offloaded inference uses) gives the logits the materialized model gives."""
    assert run_ranks(1, _logits_body, str(tmp_path))[0] < 1e-5


def _logits_body(run_dir):
    import torch

    from behemoth.config import Config
    from behemoth.engine import build_model
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import materialize
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(tiny_config(run_dir, *PLACEMENTS["all"], "model.tie_embeddings=true"))
    rt = init_runtime(timeout_s=60)
    model = build_model(cfg, rt)
    inputs = [torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    streamed = model.executor.logits(inputs)
    plain = build_causal_lm(cfg.model)
    materialize(plain.module, seed=cfg.train.seed, device=torch.device("cpu"), init_spec=plain.init_spec)
    err = max(float((plain.logits(x) - s).abs().max()) for x, s in zip(inputs, streamed))
    model.close()
    rt.close()
    return err
