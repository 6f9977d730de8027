"""What each pipeline schedule can run: one refusal (value, constraint, fix) per impossible request, before it is built.

Kept apart from the schedules so that every schedule module can refuse its own requests without importing the registry.
"""

from __future__ import annotations

from behemoth.parallel.pipeline.actions import ScheduleError

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "chimera", "zbv", "dualpipev", "1f1b-scp")
V_SCHEDULES = ("zbv", "dualpipev")  # two model chunks per rank, placed in a V


def _refuse(name: str, p: int, m: int, v: int) -> tuple[str, str] | None:
    """(problem, fix) for a request the schedule cannot run, or None."""
    if name not in SCHEDULE_NAMES:
        return f"schedule={name!r} is not one of {', '.join(SCHEDULE_NAMES)}", "pick one of those"
    if p < 1:
        return f"stages={p}: a pipeline needs at least one stage", "use --stages 1 or more"
    if m < 1:
        return f"microbatches={m}: a step needs at least one micro-batch", f"use --microbatches {p} or more to fill the pipeline"
    if name in V_SCHEDULES and v not in (1, 2):  # 1: the caller's default for a schedule that does not interleave
        return f"chunks={v}: {name} holds exactly 2 model chunks per rank, placed in a V", "use --chunks 2 (or leave it unset)"
    if name == "dualpipev" and m < 2 * p:
        return f"microbatches={m}: DualPipeV needs at least 2 x stages={p} micro-batches (one per model stage)", f"use --microbatches {2 * p} or more"
    if name not in V_SCHEDULES and name != "interleaved" and v != 1:
        return (
            f"chunks={v}: only the interleaved schedule holds several model chunks per rank (zbv and dualpipev: 2)",
            "drop --chunks or use interleaved",
        )
    if name == "interleaved" and v < 2:
        return f"chunks={v}: interleaved 1F1B needs at least 2 model chunks per rank", "use --chunks 2 or more, or the 1f1b schedule"
    if name == "interleaved" and m % p:
        return (
            f"microbatches={m}: interleaved 1F1B needs micro-batches divisible by stages={p} (as Megatron-LM)",
            f"use --microbatches {m + p - m % p}",
        )
    if name == "chimera" and p % 2:
        return (
            f"stages={p}: Chimera needs an even number of stages (rank i holds stages i and D-1-i)",
            f"use --stages {p + 1}" + (f" or {p - 1}" if p > 1 else ""),
        )
    if name == "chimera" and m % p:
        lower = f"{m - m % p} or " if m > p else ""
        return (
            f"microbatches={m}: Chimera runs whole basic units of D={p} micro-batches (D/2 down, D/2 up)",
            f"use --microbatches {lower}{m + p - m % p}",
        )
    return None


def check_request(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError (value, constraint, fix) unless schedule `name` can run p ranks, m micro-batches, v chunks."""
    refusal = _refuse(name, p, m, v)
    if refusal is not None:
        raise ScheduleError(*refusal)
