"""What a burst plan (parallel.burst) cannot run with, found before launch: one line per reason."""

from __future__ import annotations

from behemoth.config import Config
from behemoth.errors import Problem
from behemoth.models.shape import ModelShape

OPTION = "parallel.burst"


def burst_problems(cfg: Config, world: int, shape: ModelShape | None) -> list[Problem]:
    """Why `cfg`'s burst widths cannot run on `world` processes (empty when they can, or when it has none)."""
    widths = cfg.parallel.burst
    if widths is None:
        return []
    why = "the burst runtime runs plain layers on sub-meshes of the job only"
    out = [Problem.of(OPTION, f"parallel.burst with {what}: {why}", fix) for what, fix in _others(cfg)]
    if shape is not None and any(shape.experts):
        out.append(Problem.of(OPTION, "parallel.burst with a mixture-of-experts model: the burst runtime runs dense blocks only", "use a dense one"))
    n_layer = shape.n_layer if shape is not None else None
    top = min(world, cfg.train.global_batch)
    if n_layer is not None and len(widths) != n_layer + 2:
        what = f"parallel.burst has {len(widths)} widths for {n_layer + 2} layers (embedding, {n_layer} blocks, head)"
        out.append(Problem.of(OPTION, what, "write it with behemoth plan --burst --out FILE for this model"))
    bad = [w for w in widths if not 1 <= w <= top]
    if bad:
        what = f"parallel.burst widths {bad} outside 1..{top} (world {world}, global batch {cfg.train.global_batch})"
        out.append(Problem.of(OPTION, what, f"replan with behemoth plan --burst --nproc {world}"))
    return out


def _others(cfg: Config) -> list[tuple[str, str]]:
    """(the setting, the fix) for each setting a burst plan does not compose with."""
    plan, train = cfg.parallel, cfg.train
    degrees = {k: v for k, v in plan.degrees().items() if k != "dp" and v not in (None, 1)}
    out = [(f"parallel.{k}={v}", f"set parallel.{k}=1 (or drop parallel.burst)") for k, v in degrees.items()]
    if plan.zero_stage:
        out.append((f"parallel.zero_stage={plan.zero_stage}", "set parallel.zero_stage=0 (every rank keeps the whole model)"))
    if plan.recompute != "none":
        out.append((f"parallel.recompute={plan.recompute}", "set parallel.recompute=none"))
    if cfg.offload.enabled:
        out.append(("offload", "turn offload off"))
    if cfg.finetune.lora.enabled:
        out.append(("finetune.lora", "train the whole model (finetune.lora.enabled=false)"))
    if train.precision != "fp32":
        out.append((f"train.precision={train.precision}", "use train.precision=fp32 (activations are re-sharded in float32)"))
    if train.compile:
        out.append(("train.compile=true", "set train.compile=false"))
    if train.loss_chunk > 0:
        out.append((f"train.loss_chunk={train.loss_chunk}", "set train.loss_chunk=0 (the head's logits are computed whole)"))
    return out
