"""Why a 2-D tensor-parallel plan (parallel.tp_mode=2d) cannot run: a degree that is no square, sizes the grid does
not split, and the layouts it does not compose with yet. One line each, before launch."""

from __future__ import annotations

import math
from typing import Any

from behemoth.errors import Problem
from behemoth.models.shape import ModelShape


def tensor2d_problems(cfg: Any, shape: ModelShape | None, micro_batch: int | None) -> list[Problem]:
    """Every reason `cfg`'s 2-D / 2.5-D tensor parallelism cannot run (empty when tp_mode is 1d or it can); `shape`: the model's
    (None: it cannot be built), `micro_batch`: sequences per micro-batch (None: unknown)."""
    plan = cfg.parallel
    if plan.tp_mode != "2.5d" and plan.tp_depth > 1:
        return [Problem.of("parallel.tp_depth", f"parallel.tp_depth={plan.tp_depth} needs parallel.tp_mode=2.5d", "set parallel.tp_mode=2.5d")]
    if plan.tp_mode in ("1d", "3d"):  # 3d: threed_problems.py
        return []
    mode, d = plan.tp_mode, plan.tp_depth if plan.tp_mode == "2.5d" else 1
    q = math.isqrt(plan.tp // d)
    if q * q * d != plan.tp or q < 2:
        near, side = max(2, q) ** 2 * d, max(2, q)
        needed = "a square q*q >= 4" if d == 1 else f"parallel.tp_depth={d} x a square q*q >= 4"
        message = f"parallel.tp_mode={mode} needs parallel.tp to be {needed} (got {plan.tp})"
        grid = f"{d} x {side} x {side}" if d > 1 else f"a {side} x {side} grid"
        return [Problem.of("parallel.tp_mode", message, f"use parallel.tp={near} ({grid})")]
    out = [Problem.of("parallel.tp_mode", f"parallel.tp_mode={mode} with {what}: not composed yet", fix) for what, fix in unsupported(cfg)]
    if shape is not None:
        bad = unsplit_sizes(shape, q, q * q)
        if bad:
            message = f"parallel.tp={plan.tp} (a {q} x {q} grid) does not split {', '.join(bad)}"
            out.append(Problem.of("parallel.tp", message, "choose sizes the grid divides"))
    if micro_batch is not None and micro_batch % (q * d):
        rows = f"q={q} grid rows" if d == 1 else f"tp_depth={d} x q={q} grid rows"
        out.append(
            Problem.of(
                "train.micro_batch",
                f"parallel.tp_mode={mode} splits each micro-batch's sequences over {rows}, but a micro-batch has {micro_batch}",
                f"use a train.micro_batch (or global_batch / dp) that is a multiple of {q * d}",
            )
        )
    return out


def unsplit_sizes(shape: ModelShape, q: int, pieces: int) -> list[str]:
    """ "name=n (by k)" for each size a grid (pieces = q*q) or cube (q^3) of side q does not split: the heads and the
    vocabulary by q, the widths by `pieces`."""
    sizes = {"model.n_head": (shape.n_head, q), "model.d_model": (shape.d_model, pieces), "the MLP width": (shape.ffn, pieces)}
    if shape.kv_heads != shape.n_head:  # grouped-query attention: each column holds the key/value heads its query heads read
        sizes["hf.kv_heads"] = (shape.kv_heads, q)
        sizes["the key/value width (kv heads x head_dim)"] = (shape.kv_width, pieces)
    sizes["model.vocab_size"] = (shape.vocab_size, q)
    return [f"{name}={n} (by {by})" for name, (n, by) in sizes.items() if n % by]


def unsupported(cfg: Any) -> list[tuple[str, str]]:
    """(what, fix) for each setting 2-D tensor parallelism does not run with."""
    plan, out = cfg.parallel, []
    checks = [
        (plan.sequence_parallel, "parallel.sequence_parallel=true (2-D splits the batch instead)", "set parallel.sequence_parallel=false"),
        (
            plan.cp > 1 and plan.tp_mode != "2d",
            f"parallel.cp={plan.cp} (context parallelism: tested with tp_mode=2d only)",
            "set parallel.cp=1, or use tp_mode=2d",
        ),
        (plan.ep > 1 or bool(getattr(cfg.model, "moe", None) and cfg.model.moe.enabled), "a mixture of experts", "use a dense model, or tp_mode=1d"),
        (plan.burst is not None, "parallel.burst", "leave parallel.burst unset"),
        (cfg.offload.enabled, "offload", "turn offload off"),
        # the families with a 2-D / 3-D plan are the model's to say (models/hf_families.py, model_problems)
        (tied_unsplit(cfg), "model.tie_embeddings=true", "set model.tie_embeddings=false"),
        (bool(getattr(cfg.model, "dropout", 0)), f"model.dropout={getattr(cfg.model, 'dropout', 0)}", "set model.dropout=0"),
        (cfg.train.loss_chunk > 0, f"train.loss_chunk={cfg.train.loss_chunk} (the head is a SUMMA product)", "set train.loss_chunk=0"),
        (cfg.train.compile, "train.compile=true", "set train.compile=false"),
        (cfg.finetune.lora.enabled, "finetune.lora (adapters)", "turn LoRA off, or use tp_mode=1d"),
    ]
    out += [(what, fix) for bad, what, fix in checks if bad]
    return out


def tied_unsplit(cfg: Any) -> bool:
    """A tied head the plan cannot split: every one but GPT-2's under 2-D / 2.5-D (twod.py's TiedHead2D)."""
    gpt2 = getattr(getattr(cfg, "hf", None), "arch", None) == "gpt2" and cfg.parallel.tp_mode in ("2d", "2.5d")
    return bool(getattr(cfg.model, "tie_embeddings", False)) and not gpt2
