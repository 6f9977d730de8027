"""The planner's answer in words: a ranked table, why the top plan beats the runner-up, and, when nothing fits, by how
much and what would."""

from __future__ import annotations

from collections.abc import Callable

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.cost import GiB, PlanCost

PARTS = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "recompute": "recomputation",
    "tp_comm": "tensor-parallel traffic",
    "dp_comm": "exposed data-parallel traffic",
    "optimizer": "optimizer step",
    "ep_comm": "expert all-to-all",
    "offload": "exposed offload traffic",
    "cp_comm": "exposed context-parallel traffic",
}


def seconds(t: float) -> str:
    """A duration readable at any size: 830 us, 53.4 ms, 4.21 s."""
    return f"{t * 1e6:.0f} us" if t < 1e-3 else f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def rate(x: float) -> str:
    """Tokens per second readable at any size: 950, 12.3k, 4.56M."""
    return f"{x:.0f}" if x < 1e4 else f"{x / 1e3:.1f}k" if x < 1e6 else f"{x / 1e6:.2f}M"


def gib(b: float) -> str:
    """GiB with the digits a small and a large model both need."""
    return f"{b / GiB:.4f}" if b < 0.1 * GiB else f"{b / GiB:.2f}" if b < 10 * GiB else f"{b / GiB:.1f}"


def table(costs: list[PlanCost], cluster: ClusterSpec) -> str:
    """The ranked plans: layout, memory of the busiest rank, step time, tokens/s, MFU (and HFU), what binds."""
    plans = [c.layout.describe() for c in costs]
    width = max([len("plan")] + [len(p) for p in plans])
    lines = [f"{'#':>2}  {'plan':<{width}}  {'GiB/rank':>9}  {'step':>9}  {'tokens/s':>9}  {'MFU':>6}  {'HFU':>6}  binding constraint"]
    for i, (cost, plan) in enumerate(zip(costs, plans), 1):
        lines.append(
            f"{i:>2}  {plan:<{width}}  {gib(cost.peak_memory):>9}  {seconds(cost.step_seconds):>9}  {rate(cost.tokens_per_s):>9}  "
            f"{cost.mfu:>6.1%}  {cost.hfu:>6.1%}  {cost.binding(cluster)}"
        )
    return "\n".join(lines)


def part_seconds(cost: PlanCost) -> dict[str, float]:
    return {k: v * cost.step_seconds for k, v in cost.shares().items()}


def why(best: PlanCost, runner: PlanCost | None, cluster: ClusterSpec) -> str:
    """A few sentences on why `best` ranks above `runner`: the parts of the step that differ most, and the memory."""
    if runner is None:
        return f"Only one plan fits: {best.layout.describe()}."
    a, b = part_seconds(best), part_seconds(runner)
    gap = runner.step_seconds - best.step_seconds
    diffs = sorted(((b[k] - a[k], k) for k in a), reverse=True)
    gains = [f"{PARTS[k]} {seconds(d)} less" for d, k in diffs if d > 0.02 * gap and d > 0][:2]
    losses = [f"{PARTS[k]} {seconds(-d)} more" for d, k in diffs if -d > 0.02 * gap and d < 0][:1]
    text = (
        f"{best.layout.describe()} beats {runner.layout.describe()} by {gap / runner.step_seconds:.1%} "
        f"({seconds(best.step_seconds)} against {seconds(runner.step_seconds)} per step)"
    )
    if gains:
        text += ": " + ", ".join(gains) + (f", for {losses[0]}" if losses else "")
    elif gap <= 1e-12 * runner.step_seconds:
        text = f"{best.layout.describe()} ties with {runner.layout.describe()} on step time and ranks first for its simpler layout"
    text += f". It needs {gib(best.peak_memory)} GiB on its busiest rank against {gib(runner.peak_memory)} GiB"
    text += f" ({gib(best.limit)} GiB usable per device); what binds it: {best.binding(cluster)}."
    return text


def unfit_advice(
    unfit: list[PlanCost], cluster: ClusterSpec, world: int, fits_on: Callable[[int], int | None], *, offload_searched: bool = True
) -> str:
    """Nothing fits: the lightest plan's shortfall, and what would fit it (more devices, offload, a smaller batch).
    `offload_searched`: the search tried the offload placements too (False: the user's offload.* options pinned one)."""
    if not unfit:
        return f"No layout of {world} devices can run this model and batch (no degrees divide them): change the world size or the batch."
    light = unfit[0]
    mem = light.busiest
    over = light.peak_memory - light.limit
    lines = [
        f"No plan fits {world} devices of {gib(light.limit)} GiB usable: the lightest, {light.layout.describe()}, needs "
        f"{gib(light.peak_memory)} GiB on pp rank {mem.rank}, {gib(over)} GiB ({over / light.limit:.0%}) more "
        f"(model states {gib(mem.states)}, activations {gib(mem.stash)}, working set {gib(mem.working + mem.deferred + mem.buffers + mem.receives)})."
    ]
    more = fits_on(world)
    if more is not None:
        lines.append(f"What would: {more} devices ({more // max(1, cluster.devices_per_node)} nodes of {cluster.devices_per_node}) fit a plan.")
    host = cluster.host.memory_gb * 1e9 / cluster.devices_per_node
    if offload_searched:
        lines.append(
            "Offload was searched too (the Adam moments in host memory, ZeRO-3 units with the moments or every state on host "
            f"memory or disk, {gib(host)} GiB of host memory per device): no placement fits either."
        )
    elif mem.optimizer > over:
        lines.append(
            f"Offloading the optimizer state ({gib(mem.optimizer)} GiB per device) to host memory ({gib(host)} GiB per device) "
            "would make room: offload.optimizer=host (the offload.* options given pin the placement; without them the search "
            "tries offload when nothing fits on the devices)."
        )
    if light.layout.micro_batch > 1 or not light.layout.recompute:
        lines.append("A smaller micro-batch or recomputation would not be enough: the search tried micro-batch 1 and full recomputation.")
    return "\n".join(lines)
