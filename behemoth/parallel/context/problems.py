"""Why a context-parallel plan cannot run: layouts it does not compose with yet, sizes it does not split, and
attention it cannot reproduce on a shard (dropout, sliding windows). One line each, before launch."""

from __future__ import annotations

from typing import Any

from behemoth.errors import Problem
from behemoth.models.shape import ModelShape
from behemoth.parallel.context.apply import heads_per_rank, resolve_mode


def context_problems(cfg: Any, shape: ModelShape | None) -> list[Problem]:
    """Every reason `cfg`'s parallel.cp cannot run (empty when cp is 1 or it can)."""
    plan = cfg.parallel
    cp = plan.cp
    if cp == 1:
        return []
    out = _combination_problems(cfg, shape)
    if cfg.model.dropout:
        out.append(
            Problem.of(
                "parallel.cp", f"parallel.cp={cp} with model.dropout={cfg.model.dropout}: the sharded attention has no dropout", "set model.dropout=0"
            )
        )
    if shape is None:
        return out
    heads = heads_per_rank(shape.n_head, plan.tp, plan.tp_mode, plan.tp_depth)
    mode = resolve_mode(plan.cp_mode, heads, cp)
    if mode == "ulysses" and heads % cp:
        tp = f" on parallel.tp={plan.tp} ({plan.tp_mode})" if plan.tp > 1 else ""
        out.append(
            Problem.of(
                "parallel.cp_mode",
                f"parallel.cp_mode=ulysses splits heads over cp, but parallel.cp={cp} does not divide "
                f"model.n_head={shape.n_head}{tp} = {heads} heads",
                "use parallel.cp_mode=ring (or auto) or a cp that divides the heads",
            )
        )
    pieces = 2 * cp if mode == "ring" else cp
    if cfg.seq_len % pieces:
        what = f"ring attention's 2 x parallel.cp={cp} = {pieces}" if mode == "ring" else f"parallel.cp={cp}"
        out.append(Problem.of("train.seq_len", f"train.seq_len={cfg.seq_len} does not cut into {what} equal chunks", f"use a multiple of {pieces}"))
    local = cfg.seq_len // cp
    if plan.sequence_parallel and plan.tp > 1 and not cfg.seq_len % pieces and local % plan.tp:
        out.append(
            Problem.of(
                "train.seq_len",
                f"parallel.sequence_parallel splits each cp rank's {local} tokens (train.seq_len={cfg.seq_len} / "
                f"parallel.cp={cp}) over parallel.tp={plan.tp}",
                f"use a seq_len that is a multiple of {cp * plan.tp * (2 if mode == 'ring' else 1)}",
            )
        )
    return out + _hf_problems(cfg)


def _combination_problems(cfg: Any, shape: ModelShape | None) -> list[Problem]:
    plan, cp = cfg.parallel, cfg.parallel.cp
    out = []
    moe = cfg.model.moe
    if (plan.ep > 1 or moe.enabled or (shape is not None and shape.experts)) and (moe.capacity_factor is not None or moe.noise != "none"):
        what = f"model.moe.capacity_factor={moe.capacity_factor}" if moe.capacity_factor is not None else f"model.moe.noise={moe.noise}"
        out.append(
            Problem.of(
                "parallel.cp",
                f"parallel.cp={cp} with MoE experts and {what}: "
                + (
                    "a routing group's capacity is filled in token order over its whole sequences"
                    if moe.capacity_factor is not None
                    else "each cp rank would draw other noise than one process does for its tokens"
                ),
                "use dropless routing (unset model.moe.capacity_factor) and model.moe.noise=none under parallel.cp",
            )
        )
    return out


def _hf_problems(cfg: Any) -> list[Problem]:
    """A transformers model whose config.json sets attention dropout, or whose layers use a sliding window shorter than
    the sequence: the ring and Ulysses attention have no dropout and are fully causal."""
    if cfg.hf is None or cfg.hf.arch is None:
        return []
    from behemoth.models import hf as hf_models
    from behemoth.models.hf_families import attention_window

    config = hf_models.transformers_config(cfg.model, cfg.hf)
    dropout = [f"{key}={getattr(config, key)}" for key in ("attention_dropout", "attn_pdrop") if getattr(config, key, 0)]
    out = (
        [
            Problem.of(
                "parallel.cp",
                f"parallel.cp={cfg.parallel.cp} with the model's {', '.join(dropout)}: the sharded attention has no dropout",
                "set model.dropout=0",
            )
        ]
        if dropout
        else []
    )
    try:
        window = attention_window(config)
    except ValueError:
        return out  # mixed layer kinds: the model's own problems say so
    if window is None or window >= cfg.seq_len:
        return out
    return out + [
        Problem.of(
            "parallel.cp",
            f"parallel.cp={cfg.parallel.cp} with a sliding attention window of {window} < train.seq_len={cfg.seq_len}: "
            "context-parallel attention is fully causal",
            "use parallel.cp=1 for this model or a seq_len within its window",
        )
    ]
