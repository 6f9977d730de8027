"""A causal LM executed as a burst plan: layer l (the embedding, each block, the head) data-parallel over the first
`widths[l]` ranks of the job, its input re-sharded along the batch from the previous layer's split.

The step runs the layers one at a time, forward then backward in reverse, each layer's input a leaf of its own
autograd graph, so the re-sharding of activations (forward) and of their gradients (backward) happens between layers
in the same order on every rank, as explicit point-to-point transfers. Each rank's head sums its rows' token losses
and divides by the global batch's target count (the one division, DESIGN's loss-scaling rule), so summing gradients
within a layer's group gives the single-process gradient; a parameter used by layers of several widths (a tied
embedding) is summed over the widest of them, which includes every rank that touched it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import nn

from behemoth.comm import all_reduce, plan_buckets, reduce_flat
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import CausalLM, counted_targets, summed_token_loss
from behemoth.parallel.burst.groups import BurstGroups, batch_rows
from behemoth.parallel.burst.reshard import Rows, reshard

BUCKET_BYTES = 25 * 2**20
PendingSum = tuple[Any, torch.Tensor, list[torch.Tensor]]  # (the all-reduce's handle, its flat buffer, the gradients)
Stashed = tuple[torch.Tensor | None, torch.Tensor] | None  # a layer's input leaf and output on this rank (None: outside)
HeadLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> the rows' scaled summed loss


def check_widths(widths: Sequence[int], n_layer: int, world: int, batch: int) -> None:
    """Refuse a plan that does not give the embedding, every block and the head one width in 1 .. min(world, batch)."""
    if len(widths) != n_layer + 2:
        raise BehemothError(f"burst plan has {len(widths)} widths for {n_layer + 2} layers", "give the embedding, each block and the head one width")
    top = min(world, batch)
    bad = [w for w in widths if not 1 <= w <= top]
    if bad:
        raise BehemothError(f"burst widths {bad} outside 1..{top} (world {world}, batch {batch})", "replan with behemoth plan --burst for this world")


class BurstModel:
    """`lm` (materialized alike on every rank) run as the burst plan `widths`; `step` gives the loss and leaves every
    parameter's gradient, summed over its group, on the ranks of that group."""

    def __init__(self, lm: CausalLM, widths: Sequence[int], groups: BurstGroups, *, batch: int, overlap: bool = False) -> None:
        check_widths(widths, lm.shape.n_layer, groups.world, batch)
        self.lm, self.widths, self.groups, self.batch = lm, tuple(widths), groups, batch
        self.blocks = cast(nn.ModuleList, lm.module.get_submodule(lm.layers.blocks))
        self.layer_params = self._layer_params()
        self.param_width = self._param_widths()
        self.overlap = overlap  # `step` sums each layer's finished gradients while earlier layers run backward
        self.ready = self._ready_params()
        self._pending: dict[int, list[PendingSum]] = {}  # width -> the sums an overlapped backward started, unfinished
        self._started: set[int] = set()  # the widths whose sums the last backward started (sync_gradients finishes them)
        self.early_sums = 0  # buckets the last overlapped backward started while earlier layers still ran backward

    def _ready_params(self) -> list[list[nn.Parameter]]:
        """ready[l]: the parameters whose gradient is complete once layer l's backward ends (l is the first layer that
        uses them: backward runs the layers in reverse)."""
        first: dict[int, int] = {}
        for layer, params in enumerate(self.layer_params):
            for p in params:
                first.setdefault(id(p), layer)
        out: list[list[nn.Parameter]] = [[] for _ in self.layer_params]
        for p, _ in self.param_width.values():
            if p.requires_grad:
                out[first[id(p)]].append(p)
        return out

    def _layer_params(self) -> list[list[nn.Parameter]]:
        model, view = self.lm.module, self.lm.layers
        first = [p for name in view.first for p in _params_of(model, name)]
        last = [p for name in view.last for p in _params_of(model, name)]
        if self.lm.shape.tied:
            last.append(cast(nn.Parameter, model.get_submodule(view.embedding).weight))
        return [first, *[list(b.parameters()) for b in self.blocks], last]

    def _param_widths(self) -> dict[int, tuple[nn.Parameter, int]]:
        """id(parameter) -> (it, the widest layer width that uses it)."""
        out: dict[int, tuple[nn.Parameter, int]] = {}
        for params, width in zip(self.layer_params, self.widths):
            for p in params:
                out[id(p)] = (p, max(width, out.get(id(p), (p, 0))[1]))
        return out

    @property
    def last(self) -> int:
        return len(self.widths) - 1

    def _layer(self, layer: int, x: torch.Tensor | None, idx: torch.Tensor, targets: torch.Tensor, head_loss: HeadLoss) -> torch.Tensor:
        """One layer's forward on this rank's rows; the head returns `head_loss` of its rows (their scaled summed loss)."""
        model, view = self.lm.module, self.lm.layers
        if layer == 0:
            return view.embed(model, idx)
        assert x is not None
        if layer == self.last:
            return head_loss(view.head(model, x), targets)
        return view.block(self.blocks[layer - 1], x, view.context(model, x))

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of the global batch `idx` -> `targets` (every rank passes all of it), gradients summed over
        their groups; the global mean loss."""
        count = int(counted_targets(targets))
        local = self.forward_backward(idx, targets, lambda logits, t: summed_token_loss(logits, t) / count, overlap=self.overlap)
        total = (local * count).reshape(1).clone()
        all_reduce(total, self.groups.job)
        self.sync_gradients()
        return float(total) / count

    def forward_backward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor,
        head_loss: HeadLoss,
        autocast: Callable[[], AbstractContextManager] = nullcontext,
        *,
        overlap: bool = False,
    ) -> torch.Tensor:
        """Forward (under `autocast`) and backward of the global batch; this rank's head loss (0 on ranks outside the
        head's group). The gradients are left unsummed, or (`overlap`) their sums are started as each layer's backward
        completes them, and `sync_gradients` finishes them."""
        if self._pending:
            raise RuntimeError(f"burst gradient sums of widths {sorted(self._pending)} were started and never finished (call sync_gradients)")
        rows = self._rows(idx)
        with autocast():
            stash = self._forward(idx, targets, head_loss, rows)
        self._started = {w for _, w in self.param_width.values()} if overlap else set()
        self.early_sums = 0
        self._backward(stash, rows, overlap)
        last = stash[self.last]
        return last[1].detach().float() if last is not None else torch.zeros((), device=rows.device)

    @torch.no_grad()
    def forward_loss(
        self, idx: torch.Tensor, targets: torch.Tensor, loss_sum: HeadLoss, autocast: Callable[[], AbstractContextManager] = nullcontext
    ) -> torch.Tensor:
        """The forward of a global batch (any number of rows, at least the widest layer's width), no gradients:
        [summed token loss, counted targets] (float64) of this rank's head rows (zeros outside the head's group)."""
        rows = self._rows(idx)
        stats = torch.zeros(2, dtype=torch.float64, device=rows.device)

        def head(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            stats[1] += counted_targets(t)
            return loss_sum(logits, t)

        with autocast():
            last = self._forward(idx, targets, head, rows)[self.last]
        if last is not None:
            stats[0] += last[1].double()
        return stats

    def _rows(self, idx: torch.Tensor) -> Rows:
        """What is re-sharded between layers for the global batch `idx`: its rows of hidden states."""
        weight = cast(torch.Tensor, self.lm.module.get_submodule(self.lm.layers.embedding).weight)
        return Rows(idx.shape[0], (idx.shape[1], self.lm.shape.d_model), weight.dtype, weight.device)

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor, head_loss: HeadLoss, rows: Rows) -> list[Stashed]:
        stash: list[Stashed] = []
        h: torch.Tensor | None = None
        for layer, width in enumerate(self.widths):
            if layer:
                h = reshard(h, rows, self.widths[layer - 1], width, self.groups, tag=layer)
            start, end = batch_rows(rows.batch, width, self.groups.rank)
            if end == start:
                stash.append(None)
                h = None
                continue
            x = h.detach().requires_grad_() if h is not None and layer else None
            out = self._layer(layer, x, idx[start:end], targets[start:end], head_loss)
            stash.append((x, out))
            h = out.detach()
        return stash

    def _backward(self, stash: list[Stashed], rows: Rows, overlap: bool = False) -> None:
        grad: torch.Tensor | None = None
        for layer in range(self.last, -1, -1):
            entry = stash[layer]
            grad_in = None
            if entry is not None:
                x, out = entry
                out.backward(grad if layer < self.last else None)
                grad_in = x.grad if x is not None else None
            if overlap:
                started = self._start_sums(self.ready[layer])
                self.early_sums += started if layer else 0
            if layer:
                grad = reshard(grad_in, rows, self.widths[layer], self.widths[layer - 1], self.groups, tag=len(self.widths) + layer)

    def params_of_width(self, width: int) -> list[nn.Parameter]:
        """The trainable parameters whose widest layer is `width` wide (held and summed by ranks 0 .. width-1)."""
        return [p for p, w in self.param_width.values() if w == width and p.requires_grad]

    @torch.no_grad()
    def _start_sums(self, params: list[nn.Parameter]) -> int:
        """Start the asynchronous sums of `params`' finished gradients over their groups, a bucket per width (every rank
        reaches the same layers in the same order, so each group's members issue its collectives alike); the buckets."""
        started = 0
        for width in sorted({self.param_width[id(p)][1] for p in params}):
            group = self.groups.group(width)
            if group is None:
                continue
            mine = [p for p in params if self.param_width[id(p)][1] == width]
            for bucket in plan_buckets(mine, BUCKET_BYTES):
                grads = _grads_of(bucket)
                flat = torch.cat([g.reshape(-1) for g in grads])
                self._pending.setdefault(width, []).append((all_reduce(flat, group, async_op=True), flat, grads))
                started += 1
        return started

    @torch.no_grad()
    def _finish_sums(self, width: int) -> None:
        """Wait for the sums of `width` that `_start_sums` started and copy them into the gradients."""
        for handle, flat, grads in self._pending.pop(width, []):
            handle.wait()
            torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)])

    @torch.no_grad()
    def sync_gradients(self, widths: Sequence[int] | None = None) -> None:
        """Sum each parameter's gradient over its group (ranks 0 .. width-1), in buckets of one width at a time (every
        width, or those of `widths`); where an overlapped backward started a width's sums, finish them instead."""
        for width in sorted(set(widths) if widths is not None else {w for _, w in self.param_width.values()}):
            if width in self._started:
                self._started.discard(width)
                self._finish_sums(width)
                continue
            group = self.groups.group(width)
            if group is None:
                continue
            for bucket in plan_buckets(self.params_of_width(width), BUCKET_BYTES):
                reduce_flat(_grads_of(bucket), functools.partial(_all_reduce_on, group=group))


def _grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of `params`, zeros where backward left none (a parameter no row of this rank reached)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [cast(torch.Tensor, p.grad) for p in params]


def _all_reduce_on(flat: torch.Tensor, group: Any) -> None:
    all_reduce(flat, group)


def _params_of(model: nn.Module, name: str) -> list[nn.Parameter]:
    try:
        return list(model.get_submodule(name).parameters())
    except AttributeError:
        return []
