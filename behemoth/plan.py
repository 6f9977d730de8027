"""ParallelPlan: the contract between the planner and the executor.

A plan is a plain, serializable value. A user can write one by hand in the `parallel:` section of a
config; the automatic planner will emit the same object.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from behemoth.errors import BehemothError
from behemoth.topology import ParallelDims, resolve_dims


class ParallelPlan(BaseModel):
    """How one training job is laid out over processes."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    dp: int | None = Field(None, ge=1, description="data-parallel degree (default: every process)")
    bucket_mb: float = Field(25.0, gt=0, description="gradient all-reduce bucket size in MiB")

    def dims(self, world_size: int) -> ParallelDims:
        """The mesh degrees this plan asks for on `world_size` processes (validated)."""
        return resolve_dims(world_size, dp=self.dp)

    def check_world_size(self, world_size: int) -> None:
        """Refuse before launch a plan that cannot run on `world_size` processes."""
        if world_size < 1:
            raise BehemothError(f"--nproc {world_size} is not a process count", "use --nproc 1 or more")
        self.dims(world_size)
