"""`behemoth estimate` for an offloaded plan: where each state lives, bytes per tier, the disk it needs (refused
before launch if the disk lacks it), the memory peak, and a step time predicted from a short calibration."""

from __future__ import annotations

from behemoth.config import Config
from behemoth.errors import BehemothError, Problem, Refused
from behemoth.offload import scratch
from behemoth.offload.calibrate import Rates
from behemoth.planner.offload import OffloadEstimate, offload_estimate, offload_problems, rank_dims

GiB = 2**30
ORDERS_SHOWN = ((1, 4, 16), ("harmony", "naive"))


def size(n: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def placement_lines(est: OffloadEstimate) -> list[str]:
    """What lives where, per rank."""
    p = est.policy
    notes = {
        "params": "float32 shard",
        "grads": "never stored (each unit steps as its gradient completes)"
        if not est.stored["grads"]
        else "float32 shard: deferred step (exact clipping) or gradients kept between micro-batches",
        "optimizer": "8-bit blockwise moments (bitsandbytes)" if p.bits == 8 else "float32 Adam moments",
    }
    lines = ["where each state lives, per rank:"]
    for kind in ("params", "grads", "optimizer"):
        lines.append(f"  {kind:<10} {getattr(p, kind):<5} {size(est.stored[kind]):>12}   {notes[kind]}")
    return lines


def traffic_lines(cfg: Config, dp: int, device_type: str) -> list[str]:
    """Bytes moved per step per rank for each order and number of micro-batches (all tiers that move bytes)."""
    mb = cfg.batch_layout(rank_dims(cfg, dp)).micro_batch
    lines = [f"bytes moved per step per rank (read + written, tiers that move bytes) with m micro-batches of {mb} per rank:"]
    ms, orders = ORDERS_SHOWN
    for order in orders if cfg.parallel.pp == 1 else ("stage",):  # under a pipeline each stage follows its schedule
        row = []
        for m in ms:
            offload = {"max_memory_gb": None} | ({"order": order} if cfg.parallel.pp == 1 else {})
            variant = cfg.replace(offload=offload, train={"micro_batch": mb, "global_batch": mb * m * dp})
            try:
                moved = offload_estimate(variant, dp, device_type=device_type).moved_per_tier(device_type)
            except BehemothError:  # a schedule that needs more micro-batches than m
                row.append(f"m={m}: -")
                continue
            row.append(f"m={m}: {size(sum(r + w for r, w in moved.values()))}")
        lines.append(f"  {order:<8} " + "   ".join(row))
    return lines


def order_of(cfg: Config, order: str) -> str:
    """The streamer's order as the report names it (under a pipeline: pipeline rank 0's stage, in its schedule's order)."""
    plan = cfg.parallel
    return f"order {order}" if plan.pp == 1 else f"pp = {plan.pp}: pipeline rank 0's stage units in {plan.schedule}'s order"


def offload_report(cfg: Config, dp: int, nproc: int, rates: Rates | None, device_type: str) -> str:
    """The whole offload section of `behemoth estimate`."""
    est = offload_estimate(cfg, dp, ranks=nproc, device_type=device_type)
    p = est.policy
    step = "fused (no clipping)" if p.fused else "deferred (exact clipping)"
    lines = [
        f"behemoth estimate (offload): {cfg.model.preset if not cfg.hf.arch else 'hf:' + cfg.hf.arch}, Ψ = {est.psi:,} parameters "
        f"({est.units} units), dp = {dp}, tp = {cfg.parallel.tp}, {nproc} process(es) on this machine; {order_of(cfg, p.order)}, "
        f"{cfg.batch_layout(rank_dims(cfg, dp)).accum} micro-batch(es) per rank, step {step}",
        *placement_lines(est),
    ]
    root = p.root or scratch.default_scratch(None, cfg.run.dir)
    lines.append(f"disk: {size(est.disk_bytes())} needed under offload.dir={root} for {nproc} rank(s), {size(scratch.free_bytes(root))} free")
    pk = est.peak
    budget = f"offload.max_memory_gb={cfg.offload.max_memory_gb}" if cfg.offload.max_memory_gb else "no budget set"
    lines.append(
        f"memory peak per rank: {size(pk.total)} = states in memory {size(pk.in_memory_states)} + resident unit "
        f"{size(pk.resident)} + prefetched (depth {est.prefetch}) {size(pk.prefetched)} + jobs in flight {size(pk.jobs)} + "
        f"activations {size(pk.activations)} ({budget})"
    )
    moved = est.moved_per_tier(device_type)
    lines.append(
        "bytes moved per step per rank: "
        + (", ".join(f"{t} read {size(r)}, written {size(w)}" for t, (r, w) in moved.items()) or "none (every tier is device memory here)")
    )
    lines += traffic_lines(cfg, dp, device_type)
    if rates is not None:
        io, compute, bound = est.step_time(rates, device_type)
        lines.append(
            f"calibration (this machine, now): disk read {rates.disk_read / 1e9:.2f} GB/s, write {rates.disk_write / 1e9:.2f} GB/s, "
            f"host copy {rates.host_copy / 1e9:.1f} GB/s, compute {rates.compute / 1e12:.3f} TFLOP/s"
        )
        lines.append(
            f"predicted step: I/O {io:.2f} s (local ranks share the disk) and compute {compute:.2f} s "
            f"({est.flops / 1e12:.2f} TFLOP per rank) overlap: bound max = {bound:.2f} s"
        )
    return "\n".join(lines)


def run_offload_estimate(cfg: Config, nproc: int, *, calibrate: bool) -> int:
    """Print the offload section; refuse (exit 2) with every problem, the disk's free space among them."""
    import torch

    from behemoth.offload.calibrate import calibrate as measure
    from behemoth.planner.offload import offload_launch_problems

    dp = cfg.parallel.dims(nproc).dp
    found: list[Problem] = offload_problems(cfg, dp) + offload_launch_problems(cfg, nproc)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    rates = None
    if calibrate:
        root = scratch.default_scratch(cfg.offload.dir, cfg.run.dir)
        mb = cfg.batch_layout(rank_dims(cfg, dp)).micro_batch * cfg.seq_len
        rates = measure(root, torch.device(device_type), matmul=(mb, cfg.model.d_model, 4 * cfg.model.d_model))
    try:
        print(offload_report(cfg, dp, nproc, rates, device_type))
    except BehemothError as err:
        if str(err) not in {pr.message for pr in found}:
            found.append(Problem("offload", str(err)))
    if found:
        raise Refused(found)
    return 0
