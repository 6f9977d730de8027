"""Pipeline parallelism: schedules as data (actions.py, schedules.py, vshape.py, shifted.py), the NCCL-safe grouping
of their transfers (p2p_groups.py),
the cut of a model into stages (partition.py), the compute passes (stage.py), the executor and `apply_pipeline`;
analysis/ holds the tools that reason about schedules without running them (simulate, validate, the rendezvous
model, measured bubbles, grids and Gantt charts, the `behemoth schedule` report)."""

from behemoth.parallel.pipeline.analysis.simulate import (
    ClosedForm,
    Costs,
    Interval,
    SimResult,
    closed_form_bubble,
    peak_stash,
    run_timeline,
    simulate,
)
from behemoth.parallel.pipeline.analysis.validate import validate
from behemoth.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    check_request,
    chimera,
    dualpipev,
    gpipe,
    interleaved,
    one_f_one_b,
    one_f_one_b_scp,
    schedule_chunks,
    zb_h1,
    zbv,
)

__all__ = [
    "SCHEDULES",
    "Action",
    "ClosedForm",
    "Costs",
    "Interval",
    "Kind",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "build_schedule",
    "check_request",
    "chimera",
    "closed_form_bubble",
    "dualpipev",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "one_f_one_b_scp",
    "peak_stash",
    "run_timeline",
    "schedule_chunks",
    "simulate",
    "validate",
    "zb_h1",
    "zbv",
]
