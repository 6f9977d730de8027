"""A tied embedding under a streamed pipeline: the first stage's embedding and the last stage's head share one weight.

Both ranks hold the embedding unit (the last stage keeps every module of it, so both copies are cut into the same
shards over dp: parallel/pipeline/partition.py `cut_model(streamed=True)`) with its own optimizer state, drawn from the
same (seed, name). The first stage's copy takes the embedding's gradient, the last stage's the head's. Each copy's
gradient is held when it completes (rather than stepped), and once the step's passes are done the two shards are
summed between the two ranks (one exchange, bitwise equal sums) and then stepped or kept as any unit's: both copies take
the same step and stay equal, as the in-memory pipeline's `sum_tied_grads` keeps them. The first stage counts the
unit in the clipping norm, the last does not. Holding the gradient to the end matters: the last stage's copy completes
at its last forward, while the first stage's needs the last stage's later backward passes first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, pair_all_reduce
from behemoth.offload.stepper import UnitSteps
from behemoth.offload.store import PendingStep, UnitStore
from behemoth.parallel.pipeline.apply import TIED_TAG


class TiedSteps:
    """The stage streamer's step hooks (executor.py `StepHooks`) on a rank that holds one copy of a tied embedding
    (`store`) whose other copy is on pipeline rank `peer`; every other unit's are `steps`'."""

    def __init__(
        self,
        steps: UnitSteps,
        store: UnitStore,
        *,
        peer: int,
        group: dist.ProcessGroup,
        counted: bool,
        timeout_s: float,
        meter: CommMeter | None = None,
    ) -> None:
        self.steps, self.store, self.peer, self.group, self.counted = steps, store, peer, group, counted
        self.timeout_s, self.meter = timeout_s, meter
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None

    def take_pending(self, store: UnitStore) -> PendingStep | None:
        return self.steps.take_pending(store)

    def gradient_complete(self, store: UnitStore, shard: torch.Tensor, grad: torch.Tensor) -> None:
        """The tied unit's gradient waits for `sum_copies`; any other unit's goes on as usual."""
        if store is self.store:
            self.held = (shard, grad)
        else:
            self.steps.gradient_complete(store, shard, grad)

    def sum_copies(self) -> None:
        """After the step's passes: the two copies' gradient shards summed, then counted (on the first stage) and
        stepped or kept. A frozen embedding (a LoRA base) holds none on either rank."""
        if self.held is None:
            return
        shard, grad = self.held
        self.held = None
        pair_all_reduce(grad, self.peer, self.group, self.meter, tag=TIED_TAG, timeout_s=self.timeout_s)
        self.steps.gradient_complete(self.store, shard, grad, counted=self.counted)
