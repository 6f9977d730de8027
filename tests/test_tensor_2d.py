"""2-D tensor parallelism (parallel.tp_mode=2d, SUMMA over a 2 x 2 grid) equals the single process.

One 4-rank run checks the layers and the model against plain PyTorch: a GPT's loss and every parameter's gradient,
each rank's parameter bytes (1/q^2 of every tensor) and the counted traffic of one linear layer (3 q (x + w)
elements, summa.py). A second trains through the command-line path and compares the per-step losses and the
exported (single-process) weights; refusals are checked before launch.
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


def _grid():
    import torch.distributed as dist

    from behemoth.comm import CommMeter
    from behemoth.parallel.tensor.summa import Grid2D

    return Grid2D.build([list(range(dist.get_world_size()))], dist.get_rank(), CommMeter())


def _check_linear(grid) -> dict[str, float]:
    """One SUMMA linear against nn.Linear: output, input and weight gradients, and the counted volume."""
    from behemoth.parallel.tensor.layers import TP_LAYOUT
    from behemoth.parallel.tensor.summa import BlockLayout, even, summa_volume
    from behemoth.parallel.tensor.twod import Linear2D

    torch.manual_seed(0)
    n, d_in, d_out = 16, 8, 12
    full = nn.Linear(d_in, d_out, bias=False)
    x = torch.randn(n, d_in, requires_grad=True)
    probe = torch.randn(n, d_out)
    (full(x) * probe).sum().backward()
    layer = Linear2D.from_module(full, "fc", grid)
    block = BlockLayout.of((n, d_in), d0=even(n, Q, grid.row, "x"), d1=even(d_in, Q, grid.col, "x"))
    out_block = BlockLayout.of((n, d_out), d0=even(n, Q, grid.row, "y"), d1=even(d_out, Q, grid.col, "y"))
    mine = block.take_local(x.detach()).requires_grad_(True)
    grid.meter.reset()
    y = layer(mine)
    (y * out_block.take_local(probe)).sum().backward()
    counted = sum(s.elements for op, s in grid.meter.ops.items() if op in ("broadcast", "reduce"))
    _close(y, out_block.take_local(full(x).detach()), "SUMMA output")
    _close(mine.grad, block.take_local(x.grad), "SUMMA input grad")
    _close(layer.weight.grad, getattr(layer.weight, TP_LAYOUT).take_local(full.weight.grad), "SUMMA weight grad")
    own = mine.detach() @ layer.weight.detach().t()  # a product missing the other k steps: what a lost broadcast gives
    bug_err = (own - out_block.take_local(full(x).detach())).abs().max().item()
    return {"counted": counted, "formula": summa_volume(n, d_in, d_out, Q), "bug_err": bug_err}


def _check_gpt(grid) -> dict[str, float]:
    """gpt-tiny's summed loss and every gradient under the 2-D plan against the same model in one process."""
    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.init import materialize
    from behemoth.parallel.tensor.layers import TP_LAYOUT
    from behemoth.parallel.tensor.twod import apply_tensor_parallel_2d

    cfg = GPTConfig(preset="gpt-tiny")
    ref, par = build_causal_lm(cfg), build_causal_lm(cfg)
    materialize(ref.module, seed=3, device=torch.device("cpu"), init_spec=ref.init_spec)
    tp = apply_tensor_parallel_2d(par.module, grid, par.tp2d_plan)
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
    return {"param_bytes": mine, "full_bytes": sum(p.numel() * p.element_size() for p in ref.module.parameters()), "names": len(full)}


def _grid_body(cfg_dict: dict) -> dict:
    """On 4 ranks: the layer and model checks, then training (one spawn for both, to keep the suite short)."""
    grid = _grid()
    return {**_check_linear(grid), **_check_gpt(grid), "run": train_body(cfg_dict)}


def test_tp2d_layers_gpt_gradients_and_training_equal_single_process(tmp_path):
    """SUMMA linear and gpt-tiny's gradients against plain PyTorch; then 4 training steps on a 2 x 2 grid: the same
    losses and (exported from its checkpoint under single-process names) the same weights as one process."""
    steps = ["train.steps=4", "train.eval_every=2", "checkpoint.every=4"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    results = run_ranks(4, _grid_body, tiny_config(tmp_path / "2d", *steps, "parallel.tp=4", "parallel.tp_mode=2d"))
    for r in results:
        assert abs(r["counted"] - r["formula"]) <= 0.01 * r["formula"], f"counted {r['counted']} elements, SUMMA formula {r['formula']}"
        assert r["param_bytes"] * Q**2 == r["full_bytes"], f"{r['param_bytes']} parameter bytes per rank, not 1/{Q**2} of {r['full_bytes']}"
        assert r["bug_err"] > 1e-3, "the control (a product missing the broadcasts) would pass the tolerance"
    assert_close_runs(ref, results[0]["run"])
    assert all(r["run"]["losses"] == results[0]["run"]["losses"] for r in results), "grid ranks disagree on the loss"


@pytest.mark.slow
def test_dp2_tp2d_zero1_equals_single_process(tmp_path):
    """dp=2 x a 2 x 2 grid (8 ranks) with ZeRO-1 over dp."""
    steps = ["train.steps=4", "train.eval_every=2"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    got = run_ranks(8, train_body, tiny_config(tmp_path / "2d", *steps, "parallel.tp=4", "parallel.tp_mode=2d", "parallel.zero_stage=1"), timeout=400)
    assert_close_runs(ref, got[0])


@pytest.mark.slow
def test_single_process_checkpoint_resumes_on_a_2d_grid(tmp_path):
    """A one-process checkpoint of step 2 continues on a 2 x 2 grid (DCP reads each rank's blocks by single-process
    name): the same losses for steps 3-4 and the same final weights."""
    steps = ["train.steps=4", "train.eval_every=2", "checkpoint.every=2"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    copy = tmp_path / "run"
    shutil.copytree(tmp_path / "ref", copy)
    cfg = tiny_config(copy, *steps, "parallel.tp=4", "parallel.tp_mode=2d")
    got = run_ranks(4, train_body, cfg, str(copy / "checkpoints/step_0000002"))[0]
    assert got["start"] == 2
    assert_close_runs({"losses": ref["losses"][2:], "weights": ref["weights"]}, got)


@pytest.mark.slow
def test_tp25d_depth2_equals_single_process(tmp_path):
    """2.5-D (Tesseract): 2 layers of a 2 x 2 grid (8 ranks), each with half of every micro-batch, weight gradients
    summed over the depth: the single-process losses and weights."""
    steps = ["train.steps=4", "train.eval_every=2", "checkpoint.every=4"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    extra = ["parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=2"]
    got = run_ranks(8, train_body, tiny_config(tmp_path / "25d", *steps, *extra), timeout=400)
    assert_close_runs(ref, got[0])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.tp=2"], "parallel.tp_mode=2d needs parallel.tp to be a square q*q >= 4 (got 2)"),
        (["parallel.tp=4", "parallel.sequence_parallel=true"], "parallel.sequence_parallel=true"),
        (["parallel.tp=4", "model.tie_embeddings=true"], "model.tie_embeddings=true"),
        (["parallel.tp=8", "parallel.tp_mode=2.5d", "parallel.tp_depth=2", "parallel.cp=2"], "context parallelism: tested with tp_mode=2d only"),
        (["parallel.tp=4", "parallel.cp=2", "parallel.cp_mode=ulysses"], "does not divide model.n_head=2 on parallel.tp=4 (2d) = 1 heads"),
        (["parallel.tp=4", "model.n_head=1", "model.d_model=34"], "does not split model.n_head=1 (by 2), model.d_model=34 (by 4)"),
        (["parallel.tp=4", "train.micro_batch=1"], "a micro-batch has 1"),
        (["parallel.tp=4", "parallel.tp_depth=2"], "parallel.tp_depth=2 needs parallel.tp_mode=2.5d"),
        (["parallel.tp=4", "parallel.tp_mode=2.5d", "parallel.tp_depth=2"], "parallel.tp_depth=2 x a square q*q >= 4 (got 4)"),
    ],
)
def test_tp2d_refused_before_launch(tmp_path, overrides, message):
    from behemoth.config import Config
    from behemoth.planner.feasibility import problems

    cfg = Config.model_validate(tiny_config(tmp_path, "parallel.tp_mode=2d", *overrides))
    world = 16 if "parallel.tp=8" in overrides else 8 if "parallel.cp=2" in overrides else 4
    found = " | ".join(p.message for p in problems(cfg, world))
    assert message in found, found


def test_block_layouts_cover_each_tensor_once():
    """Over the q^2 ranks, a packed [q|k|v] weight's blocks and its bias pieces tile the full tensor exactly once."""
    from behemoth.parallel.tensor.summa import Grid2D
    from behemoth.parallel.tensor.twod import Linear2D

    full = nn.Linear(8, 24, device="meta")
    weight, bias = torch.zeros(24, 8), torch.zeros(24)
    for r in range(Q * Q):
        layer = Linear2D.from_module(full, "qkv", Grid2D(Q, r // Q, r % Q, None, None), parts=3)
        for target, param in ((weight, layer.weight), (bias, layer.bias)):
            for f, _, size in param._behemoth_tp_layout.boxes():
                target[tuple(slice(o, o + s) for o, s in zip(f, size))] += 1
        assert math.prod(layer.weight.shape) * Q * Q == weight.numel()
    assert torch.equal(weight, torch.ones_like(weight)) and torch.equal(bias, torch.ones_like(bias))
