"""Pipeline parallelism: schedules as data, their validation, simulation, pictures and the `behemoth schedule` report."""

from behemoth.parallel.pipeline.schedules import (
    SCHEDULES, Action, Kind, Schedule, ScheduleError, build_schedule, check_request, chimera, gpipe, interleaved,
    one_f_one_b, zb_h1,
)
from behemoth.parallel.pipeline.simulate import ClosedForm, Costs, Interval, SimResult, closed_form_bubble, peak_stash, run_timeline, simulate
from behemoth.parallel.pipeline.validate import validate

__all__ = [
    "SCHEDULES", "Action", "ClosedForm", "Costs", "Interval", "Kind", "Schedule", "ScheduleError", "SimResult",
    "build_schedule", "check_request", "chimera", "closed_form_bubble", "gpipe", "interleaved", "one_f_one_b",
    "peak_stash", "run_timeline", "simulate", "validate", "zb_h1",
]
