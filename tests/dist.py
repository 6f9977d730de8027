"""The one multi-process test helper: `run_ranks(world, body, *args)` (see behemoth/faults/ranks.py)."""

from behemoth.faults.ranks import run_ranks

__all__ = ["run_ranks"]
