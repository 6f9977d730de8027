"""A trial joined by a second worker (data parallelism when there are fewer ready trials than idle workers): one shard
task split by rows of every micro-batch over two workers, and the two answers merged into the one the trial's chain
expects. The first half runs on the trial's spilled shard as any task does; the second on a snapshot of it (a shared
host buffer the scheduler copies the shard into before it sends the halves), so the two never write the same buffer.
Both apply the shard's pending optimizer step (the same floating-point operations on the same states: the same
weights). The merge sums the second half's gradient into the shard's own (the data-parallel reduction) and takes the
gradient squares of the sum; losses and validation sums add, boundary tensors are concatenated again. Results differ
from the trial alone only by that reassociation (each half's matmuls over fewer rows, a sum of two partial gradients)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from behemoth.sweep.hydra.shards import Shard

Task = dict[str, Any]
SPLIT = ("inputs", "targets", "grad_outputs")  # per micro-batch tensors split by rows; tied_grads go with the first half


def splittable(task: Task) -> bool:
    """A task with at least two rows in every micro-batch can be split over two workers (not one that draws dropout
    masks: their values depend on the rows drawn at once)."""
    return task.get("rngs") is None and all(h.shape[0] >= 2 for h in task["inputs"])


def halves(task: Task, snapshot_key: str) -> tuple[Task, Task]:
    """The task's two halves: rows [0, ceil(B/2)) on the spilled shard, the rest on the snapshot (the shard's copy)."""
    first, second = dict(task), dict(task, host=snapshot_key)
    for key in SPLIT:
        if task.get(key) is not None:
            parts = [torch.tensor_split(t, 2, dim=0) for t in task[key]]
            first[key], second[key] = [p[0] for p in parts], [p[1] for p in parts]
    second["tied_grads"] = None  # the head's part of a tied embedding's gradient is added once, by the first half
    return first, second


def snapshot(buffers: list[torch.Tensor], index: int, have: torch.Tensor | None) -> torch.Tensor:
    """A trial's shared snapshot buffer (as large as its largest shard's, made once: `have`) holding a copy of shard
    `index`'s states in its first values."""
    if have is None:
        have = torch.empty(max(b.numel() for b in buffers)).share_memory_()
    have[: buffers[index].numel()].copy_(buffers[index])
    return have


@dataclass
class Join:
    """A task split over two workers: its halves' ids and their answers as they come."""

    task: Task
    snapshot: torch.Tensor
    ids: tuple[int, int]
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)

    def add(self, answer: dict[str, Any]) -> bool:
        """Keep an answer; True once both halves have answered."""
        self.answers[answer["id"]] = answer
        return len(self.answers) == 2

    def merged(self, host: torch.Tensor) -> dict[str, Any]:
        """The answer the trial's chain expects, as if one worker had run the whole task (`host`: the shard's buffer)."""
        a, b = (self.answers[i] for i in self.ids)
        wall = max(a["wall_s"], b["wall_s"])
        if not a["ok"] or not b["ok"]:
            bad = a if not a["ok"] else b
            return bad | {"wall_s": wall}
        out: dict[str, Any] = {"ok": True, "wall_s": wall, "joined": True}
        for key in ("outputs", "grad_inputs"):
            if key in a:
                out[key] = [None if x is None else torch.cat([x, y]) for x, y in zip(a[key], b[key])]  # token ids have no gradient
        if "stats" in a:
            out["stats"] = [x + y for x, y in zip(a["stats"], b["stats"])]
        if "losses" in a:
            out["losses"] = [x + y for x, y in zip(a["losses"], b["losses"])]
            out["tied_grads"] = [None if x is None else x + y for x, y in zip(a["tied_grads"], b["tied_grads"])]
        if "squares" in a:
            out["squares"] = self.reduce(host)
        return out

    def reduce(self, host: torch.Tensor) -> list[float]:
        """The data-parallel reduction: the second half's gradient summed into the shard's; each parameter's |g|^2."""
        shard: Shard = self.task["shard"]
        n = shard.numel
        grad = host[n : 2 * n]
        grad.add_(self.snapshot[n : 2 * n])
        return [float(torch.linalg.vector_norm(grad[o : o + size], dtype=torch.float32).square()) for o, size in zip(shard.offsets(), sizes(shard))]


def sizes(shard: Shard) -> list[int]:
    return [int(torch.Size(s).numel()) for s in shard.shapes]


def snapshot_key(trial: str) -> str:
    return f"{trial}/snapshot"


class Joins:
    """The scheduler's joined tasks: each trial's one in flight, its snapshot buffer, how many of its tasks ran joined."""

    def __init__(self) -> None:
        self.open: dict[str, Join] = {}
        self.snapshots: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}

    def buffers(self, trial: str) -> dict[str, torch.Tensor]:
        """The trial's snapshot buffer by its key, for the workers (once it has one)."""
        return {snapshot_key(trial): self.snapshots[trial]} if trial in self.snapshots else {}

    def split(self, trial: str, host: list[torch.Tensor], task: Task) -> tuple[Task, Task]:
        """The task's halves, after its shard's states are copied into the trial's snapshot buffer."""
        self.snapshots[trial] = snapshot(host, task["shard"].index, self.snapshots.get(trial))
        self.count[trial] = self.count.get(trial, 0) + 1
        return halves(task, snapshot_key(trial))

    def started(self, trial: str, task: Task, ids: tuple[int, int]) -> None:
        self.open[trial] = Join(task, self.snapshots[trial], ids)

    def answer(self, trial: str, answer: dict[str, Any], host: list[torch.Tensor]) -> dict[str, Any] | None:
        """A worker's answer as the trial's chain takes it: as is, or (half of a joined task) None until the other half
        has answered, then the two merged."""
        join = self.open.get(trial)
        if join is None:
            return answer
        if not join.add(answer):
            return None
        del self.open[trial]
        return join.merged(host[join.task["shard"].index])

    def drop(self, trial: str, *, let_go: bool) -> None:
        """A trial's segment ended: its joined task (if one was in flight) is void; `let_go`: the trial is done."""
        self.open.pop(trial, None)
        if let_go:
            self.snapshots.pop(trial, None)
