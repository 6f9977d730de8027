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
    """A task with at least two rows in every micro-batch can be split over two workers."""
    return all(h.shape[0] >= 2 for h in task["inputs"])


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
