"""Why a 3-D tensor-parallel plan (parallel.tp_mode=3d) cannot run: a degree that is no cube, sizes the cube does not
split, and the layouts it does not compose with yet (2-D's). One line each, before launch."""

from __future__ import annotations

from typing import Any

from behemoth.errors import Problem
from behemoth.models.shape import ModelShape
from behemoth.parallel.tensor.cube import cube_side
from behemoth.parallel.tensor.twod_problems import unsplit_sizes, unsupported


def tensor3d_problems(cfg: Any, shape: ModelShape | None, micro_batch: int | None) -> list[Problem]:
    """Every reason `cfg`'s 3-D tensor parallelism cannot run (empty when tp_mode is not 3d or it can); `shape`: the
    model's (None: it cannot be built), `micro_batch`: sequences per micro-batch (None: unknown)."""
    plan = cfg.parallel
    if plan.tp_mode != "3d":
        return (
            [Problem.of("parallel.tp_regather", "parallel.tp_regather=true needs parallel.tp_mode=3d", "set parallel.tp_mode=3d")]
            if plan.tp_regather
            else []
        )
    q = cube_side(plan.tp)
    if q < 2:
        message = f"parallel.tp_mode=3d needs parallel.tp to be a cube q*q*q >= 8 (got {plan.tp})"
        return [Problem.of("parallel.tp_mode", message, "use parallel.tp=8 (2 x 2 x 2)")]
    out = [Problem.of("parallel.tp_mode", f"parallel.tp_mode=3d with {what}: not composed yet", fix) for what, fix in unsupported(cfg)]
    if shape is not None:
        bad = unsplit_sizes(shape, q, q**3)
        if bad:
            message = f"parallel.tp={plan.tp} (a {q} x {q} x {q} cube) does not split {', '.join(bad)}"
            out.append(Problem.of("parallel.tp", message, "choose sizes the cube divides"))
    if micro_batch is not None and micro_batch % (q * q):
        message = f"parallel.tp_mode=3d splits each micro-batch's sequences in q^2={q * q} blocks, but a micro-batch has {micro_batch}"
        out.append(Problem.of("train.micro_batch", message, f"use a train.micro_batch (or global_batch / dp) that is a multiple of {q * q}"))
    return out
