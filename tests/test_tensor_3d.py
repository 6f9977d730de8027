"""3-D tensor parallelism (parallel.tp_mode=3d, all-gather / reduce-scatter over a 2 x 2 x 2 cube) equals the single
process.

One 8-rank run checks a cube linear against nn.Linear (output, input and weight gradients; the counted all-gather +
reduce-scatter elements against 2 q (x + w + y), and what a ring moves of them against Bian et al.'s
2 (q-1) (X + W + Y) / q^3, cube.py) and gpt-tiny's summed loss and every gradient, with each
rank's parameter bytes exactly 1/q^3 of the model's and (parallel.tp_regather) its saved activation bytes 1/q^3 of
one process's, up to the per-token statistics. Training through the command-line path is slow-marked (8
processes on 2 cores); refusals are checked before launch.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from torch import nn

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

Q = 2


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _cube():
    import torch.distributed as dist

    from behemoth.comm import CommMeter
    from behemoth.parallel.tensor.cube import Grid3D

    return Grid3D.build([list(range(dist.get_world_size()))], dist.get_rank(), CommMeter())


def _activation(full: torch.Tensor, grid, feature_axis: str) -> torch.Tensor:
    """The rank's block of a [tokens, h] activation with features on `feature_axis` (tokens in q^2 blocks)."""
    from behemoth.parallel.tensor.summa import BlockLayout, even

    n, h = full.shape
    layout = BlockLayout.of((n, h), d0=even(n, Q * Q, grid.batch_index(feature_axis), "x"), d1=even(h, Q, grid.coord(feature_axis), "x"))
    return layout.take_local(full)


def _check_linear(grid) -> dict[str, float]:
    """One cube linear (A -> B) against nn.Linear: output, input and weight gradients, and the counted volume; saving
    the gathered operands (the default) and gathering them again in backward (tp_regather)."""
    import dataclasses

    out = _check_linear_on(grid)
    again = _check_linear_on(dataclasses.replace(grid, regather=True))
    return {**out, "regather_counted": again["counted"], "regather_formula": again["regather_formula"]}


def _check_linear_on(grid) -> dict[str, float]:
    from behemoth.parallel.tensor.cube import cube_volume, ring_volume
    from behemoth.parallel.tensor.layers import TP_LAYOUT
    from behemoth.parallel.tensor.summa import even
    from behemoth.parallel.tensor.threed import Linear3D

    torch.manual_seed(0)
    n, d_in, d_out = 16, 8, 12
    full = nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(n, d_in, requires_grad=True)
    probe = torch.randn(n, d_out)
    (full(x) * probe).sum().backward()
    layer = Linear3D.from_module(full, "fc", grid, "a")
    mine = _activation(x.detach(), grid, "a").requires_grad_(True)
    grid.meter.reset()
    y = layer(mine)
    (y * _activation(probe, grid, "b")).sum().backward()
    counted = sum(s.elements for op, s in grid.meter.ops.items() if op in ("all_gather", "reduce_scatter"))
    _close(y, _activation(full(x).detach(), grid, "b"), "cube output")
    _close(mine.grad, _activation(x.grad, grid, "a"), "cube input grad")
    _close(layer.weight.grad, getattr(layer.weight, TP_LAYOUT).take_local(full.weight.grad), "cube weight grad")
    # the control: what a lost reduce-scatter gives, this rank's tokens x A's input block a only (no sum over a)
    tokens = even(n, Q * Q, grid.batch_index("b"), "y")[0]
    ins, outs = even(d_in, Q, grid.coord("a"), "x")[0], even(d_out, Q, grid.coord("b"), "y")[0]
    rows_x = x.detach()[tokens[0] : tokens[0] + tokens[2], ins[0] : ins[0] + ins[2]]
    partial = rows_x @ full.weight.detach()[outs[0] : outs[0] + outs[2], ins[0] : ins[0] + ins[2]].t()
    bug_err = (partial - y.detach()).abs().max().item()
    volumes = {"counted": counted, "formula": cube_volume(n, d_in, d_out, Q), "published": ring_volume(n, d_in, d_out, Q)}
    volumes["regather_formula"] = cube_volume(n, d_in, d_out, Q, regather=True)
    return {**volumes, "weight_elems": layer.weight.numel(), "bug_err": bug_err}


def _check_gpt(grid) -> dict[str, float]:
    """gpt-tiny's summed loss and every gradient under the 3-D plan against the same model in one process."""
    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.init import materialize
    from behemoth.parallel.tensor.layers import TP_LAYOUT
    from behemoth.parallel.tensor.threed import apply_tensor_parallel_3d

    cfg = GPTConfig(preset="gpt-tiny")
    ref, par = build_causal_lm(cfg), build_causal_lm(cfg)
    materialize(ref.module, seed=3, device=torch.device("cpu"), init_spec=ref.init_spec)
    tp = apply_tensor_parallel_3d(par.module, grid, par.tp3d_plan)
    materialize(par.module, seed=3, device=torch.device("cpu"), init_spec=par.init_spec)
    gen = torch.Generator().manual_seed(5)
    idx, targets = torch.randint(0, 256, (4, 16), generator=gen), torch.randint(0, 256, (4, 16), generator=gen)
    ref_loss = summed_token_loss(ref.module(idx), targets)
    ref_loss.backward()
    loss = tp.cross_entropy_sum(par.module(idx), targets)
    loss.backward()
    _close(loss, ref_loss, "GPT summed loss")
    full = dict(ref.module.named_parameters())
    for name, p in par.module.named_parameters():
        _close(p.grad, getattr(p, TP_LAYOUT).take_local(full[name].grad), f"{name} grad", rtol=1e-4, atol=1e-6)
    mine = sum(p.numel() * p.element_size() for p in par.module.parameters())
    out = {"param_bytes": mine, "full_bytes": sum(p.numel() * p.element_size() for p in ref.module.parameters())}
    return {**out, **_saved_bytes(ref, cfg, grid, idx, targets)}


def _saved_bytes(ref, cfg, grid, idx, targets) -> dict[str, int]:
    """Bytes autograd saves in one forward and loss: the model in one process, and a rank under tp_regather."""
    import dataclasses

    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.init import materialize
    from behemoth.parallel.tensor.activations import SavedBytesMeter
    from behemoth.parallel.tensor.threed import apply_tensor_parallel_3d

    par = build_causal_lm(cfg)
    tp = apply_tensor_parallel_3d(par.module, dataclasses.replace(grid, regather=True), par.tp3d_plan)
    materialize(par.module, seed=3, device=torch.device("cpu"), init_spec=par.init_spec)
    full, mine = SavedBytesMeter({}, list(ref.module.parameters())), SavedBytesMeter({}, list(par.module.parameters()))
    with full.measure():
        summed_token_loss(ref.module(idx), targets)
    with mine.measure():
        tp.cross_entropy_sum(par.module(idx), targets)
    return {"saved_full": full.total, "saved_mine": mine.total}


def _cube_body() -> dict:
    grid = _cube()
    return {**_check_linear(grid), **_check_gpt(grid)}


def test_tp3d_linear_and_gpt_gradients_equal_single_process():
    """On a 2 x 2 x 2 cube (8 gloo ranks): a cube linear and gpt-tiny's loss and gradients against plain PyTorch."""
    results = run_ranks(8, _cube_body, timeout=300)
    for r in results:
        assert abs(r["counted"] - r["formula"]) <= 0.01 * r["formula"], f"counted {r['counted']} elements, 3-D formula {r['formula']}"
        assert r["regather_counted"] == r["regather_formula"], f"regather: counted {r['regather_counted']}, formula {r['regather_formula']}"
        moved = r["counted"] * (Q - 1) / Q  # a ring all-gather / reduce-scatter moves (q-1)/q of what the meter counts
        assert abs(moved - r["published"]) <= 0.01 * r["published"], f"ring moves {moved} elements, Bian et al.: {r['published']}"
        assert r["weight_elems"] * Q**3 == 8 * 12, f"{r['weight_elems']} weight elements per rank, not 1/{Q**3}"
        assert r["bug_err"] > 1e-3, "the control (a product missing the reduce-scatter) would pass the tolerance"
        # tp_regather: 1/q^3 of what one process saves, up to the per-token tensors (LayerNorm's 1/std, the loss's
        # statistics), which every rank of an A line holds: 2.2% here at d_model=32, 0.3% at gpt-6m (bench_tp.py --part 3d)
        saved = r["saved_mine"] * Q**3 / r["saved_full"]
        assert 1.0 <= saved <= 1.05, f"a rank saves {saved:.3f} / q^3 of the single process's activation bytes"
        assert r["param_bytes"] * Q**3 == r["full_bytes"], f"{r['param_bytes']} parameter bytes per rank, not 1/{Q**3} of {r['full_bytes']}"


@pytest.mark.slow
@pytest.mark.parametrize("regather", [False, True])
def test_tp3d_training_equals_single_process(tmp_path, regather):
    """4 training steps on a 2 x 2 x 2 cube (saving the gathered operands, or gathering them again in backward): the
    single-process losses and (exported from its checkpoint under single-process names) weights."""
    steps = ["train.steps=4", "train.eval_every=2", "checkpoint.every=4"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    extra = ["parallel.tp=8", "parallel.tp_mode=3d", f"parallel.tp_regather={str(regather).lower()}"]
    got = run_ranks(8, train_body, tiny_config(tmp_path / "3d", *steps, *extra), timeout=400)
    assert_close_runs(ref, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "cube ranks disagree on the loss"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.tp=4"], "parallel.tp_mode=3d needs parallel.tp to be a cube q*q*q >= 8 (got 4)"),
        (["parallel.tp=8", "model.tie_embeddings=true"], "model.tie_embeddings=true"),
        (["parallel.tp=8", "model.d_model=36", "model.n_head=3"], "does not split model.n_head=3 (by 2), model.d_model=36 (by 8)"),
        (["parallel.tp=8", "train.global_batch=2"], "a micro-batch has 2"),
        (["parallel.tp=8", "parallel.tp_depth=2"], "parallel.tp_depth=2 needs parallel.tp_mode=2.5d"),
        (["parallel.tp=4", "parallel.tp_mode=2d", "parallel.tp_regather=true"], "parallel.tp_regather=true needs parallel.tp_mode=3d"),
    ],
)
def test_tp3d_refused_before_launch(tmp_path, overrides, message):
    from behemoth.config import Config
    from behemoth.planner.feasibility import problems

    cfg = Config.model_validate(tiny_config(tmp_path, "parallel.tp_mode=3d", *overrides))
    world = 16 if "parallel.pp=2" in overrides else 8 if "parallel.tp=8" in overrides else 4
    found = " | ".join(p.message for p in problems(cfg, world))
    assert message in found, found


def test_cube_layouts_cover_each_tensor_once():
    """Over the q^3 ranks, a packed [q|k|v] weight's pieces and its bias pieces tile the full tensor exactly once."""
    from behemoth.parallel.tensor.cube import Grid3D
    from behemoth.parallel.tensor.threed import Linear3D

    full = nn.Linear(16, 48, device="meta")
    weight, bias = torch.zeros(48, 16), torch.zeros(48)
    for r in range(Q**3):
        layer = Linear3D.from_module(full, "qkv", Grid3D.shape_only(Q, r), "a", parts=3)
        for target, param in ((weight, layer.weight), (bias, layer.bias)):
            for f, _, size in param._behemoth_tp_layout.boxes():
                target[tuple(slice(o, o + s) for o, s in zip(f, size))] += 1
        assert math.prod(layer.weight.shape) * Q**3 == weight.numel()
    assert torch.equal(weight, torch.ones_like(weight)) and torch.equal(bias, torch.ones_like(bias))


@pytest.mark.slow
def test_dp2_tp3d_zero1_equals_single_process(tmp_path):
    """dp=2 x a 2 x 2 x 2 cube (16 ranks: two cubes, each with half of every batch) with ZeRO-1 over dp."""
    steps = ["train.steps=3", "train.eval_every=3", "train.global_batch=16"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    extra = ["parallel.tp=8", "parallel.tp_mode=3d", "parallel.zero_stage=1"]
    got = run_ranks(16, train_body, tiny_config(tmp_path / "3d", *steps, *extra), timeout=600)
    assert_close_runs(ref, got[0])


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_a_cube(tmp_path):
    """A one-process checkpoint of step 2 continues on a 2 x 2 x 2 cube (DCP reads each rank's pieces by
    single-process name): the same losses for steps 3-4 and the same final weights."""
    steps = ["train.steps=4", "train.eval_every=2", "checkpoint.every=2"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    copy = tmp_path / "run"
    shutil.copytree(tmp_path / "ref", copy)
    cfg = tiny_config(copy, *steps, "parallel.tp=8", "parallel.tp_mode=3d")
    got = run_ranks(8, train_body, cfg, str(copy / "checkpoints/step_0000002"), timeout=400)[0]
    assert got["start"] == 2
    assert_close_runs({"losses": ref["losses"][2:], "weights": ref["weights"]}, got)
