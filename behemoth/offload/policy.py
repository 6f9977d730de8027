"""What a run asks of offload: the tier of each kind of state, how units stream, when they step, the memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from behemoth.offload import scratch
from behemoth.parallel.zero.tiers import tier_name


@dataclass(frozen=True)
class OffloadPolicy:
    """Where parameters, gradients and optimizer state live, and how they stream."""

    params: str = "device"  # a tier (parallel/zero/tiers.py); the older spellings none and cpu are read as device and host
    grads: str = "device"
    optimizer: str = "device"
    root: Path | None = None  # the scratch directory of the disk tier
    run_dir: str | None = None  # the run that claims it
    prefetch: int = 2
    io_threads: int = 2
    order: str = "harmony"
    fused: bool = False  # step during backward (no clipping) or deferred to the next fetch
    bits: int = 32
    max_memory_bytes: float | None = None  # the budget the prefetch depth and the jobs in flight must fit
    param_dtype: str = "fp32"  # parallel.param_dtype: units computed with in bf16, float32 masters on their tier (as ZeRO-3)
    journal: bool = False  # offload.commit=journal: each step committed through a redo log (offload/journal.py)
    resume: bool = False  # a resumed run: a journaled scratch this run left is reopened, not drawn again

    def __post_init__(self) -> None:
        for kind in ("params", "grads", "optimizer"):
            object.__setattr__(self, kind, tier_name(getattr(self, kind)))

    @classmethod
    def of(cls, offload: Any, *, run_dir: str | None, grad_clip: float, param_dtype: str = "fp32", resume: bool = False) -> OffloadPolicy:
        """The policy an `offload` config section and the run ask for (offload.step=auto: fused without clipping, unless
        journaled; `param_dtype`: parallel.param_dtype; `resume`: the run resumes)."""
        fused = steps_in_backward(offload.step, grad_clip, offload.commit)
        budget = offload.max_memory_gb * 2**30 if offload.max_memory_gb else None
        return cls(
            offload.params,
            offload.grads_tier,
            offload.optimizer,
            scratch.default_scratch(offload.dir, run_dir),
            run_dir,
            offload.prefetch,
            offload.io_threads,
            offload.order,
            fused,
            offload.optimizer_bits,
            budget,
            param_dtype,
            offload.commit == "journal",
            resume,
        )

    @property
    def tiers(self) -> dict[str, str]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}

    @property
    def optimizer_only(self) -> bool:
        """Only the optimizer's float32 moments off the device, in host memory: at ZeRO stages 1-2 that is ZeRO-Offload
        (the ZeRO sync keeps its moments on the host tier; nothing streams)."""
        return self.params == self.grads == "device" and self.optimizer == "host" and self.bits == 32

    @property
    def compute_bytes(self) -> int:
        """Bytes of one element of a unit as computed with (and of its gradient): 2 for bf16, 4 for float32."""
        return 2 if self.param_dtype == "bf16" else 4

    @property
    def uses_disk(self) -> bool:
        return "disk" in self.tiers.values()


def steps_in_backward(step: str, grad_clip: float, commit: str = "link") -> bool:
    """Whether offload.step (with train.grad_clip) fuses the optimizer step into backward: `fused`, or `auto` unclipped
    (offload.commit=journal logs the gradients instead: never fused)."""
    return step == "fused" or (step == "auto" and grad_clip == 0 and commit != "journal")
