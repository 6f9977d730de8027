"""The one multi-process test helper: `run_ranks(world, body, *args)` (see behemoth/ranks.py)."""

from behemoth.ranks import run_ranks

__all__ = ["run_ranks"]
