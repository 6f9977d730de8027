"""Several LoRA adapters served over one base, unmerged, in one batch (S-LoRA / Punica style, in plain torch).

Every adapted linear layer keeps its base weight W and gets a forward hook that adds, for each row of the step,
its own adapter's (alpha / r) B A x: the adapters' A and B are stacked ([n + 1, r, in], [n + 1, out, r], slot 0 the
base: zeros; ranks padded with zeros; the scaling folded into B) and gathered per row, so one forward serves rows
of different adapters and of the base together. The scheduler tells the runner each row's slot
(`StepBatch.adapters`); a step without adapter rows runs the base alone. A row's output equals that of the model
with its adapter merged (W + (alpha / r) B A) within float32 rounding.

Under tensor parallelism each adapter is split like the base layer it adapts (parallel/tensor/adapters.py's rule):
over a column-parallel layer A is whole and B keeps this rank's output features; over a row-parallel layer A keeps
this rank's input features, and the r-wide products A_r x_r are summed over tp before B (one small all-reduce).
Every rank builds its bank from the same folders and gets each step's row slots with the batch. Under a pipeline each
rank adapts the layers of the blocks it holds, and each micro-batch carries its rows' slots through the stages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.peft_io import Adapter, read_adapter
from behemoth.parallel.tensor.comm import TPComm, reduce_from_tp
from behemoth.parallel.tensor.layers import TP_LAYOUT, ColumnParallelLinear, RowParallelLinear, ShardLayout


def local_part(layout: ShardLayout | None, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of an adapter matrix split as the base weight is along its dimension (whole without a layout)."""
    return full if layout is None else replace(layout, full_shape=tuple(full.shape)).take_local(full)


def stacked(
    adapters: list[Adapter], module: str, weight: torch.Tensor, split: tuple[str, ShardLayout] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n + 1, r, in], [n + 1, out, r]): every adapter's A and scaled B of `module` (zeros where it has none); `split`
    ("column" or "row", the base weight's layout): this rank's part, B's outputs or A's inputs."""
    layout = None if split is None else split[1]
    out_features, in_features = layout.full_shape if layout is not None else weight.shape
    rank = max(a.rank for a in adapters)
    A = torch.zeros((len(adapters) + 1, rank, in_features), dtype=torch.float32)
    B = torch.zeros((len(adapters) + 1, out_features, rank), dtype=torch.float32)
    for i, adapter in enumerate(adapters, start=1):
        a, b = adapter.tensors.get(f"{module}.lora_A.weight"), adapter.tensors.get(f"{module}.lora_B.weight")
        if a is None or b is None:
            continue
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise BehemothError(
                f"adapter {i}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, the model's weight {tuple(weight.shape)}",
                "use adapters trained on this base model",
            )
        A[i, : a.shape[0]] = a.float()
        B[i, :, : b.shape[1]] = b.float() * adapter.scaling
    if split is not None and split[0] == "row":
        A = torch.stack([local_part(split[1], m) for m in A])
    elif split is not None:
        B = torch.stack([local_part(split[1], m) for m in B])
    return A.to(weight.device, weight.dtype), B.to(weight.device, weight.dtype)


def tensor_split(layer: nn.Module | None, name: str) -> tuple[str, ShardLayout, TPComm | None] | None:
    """How a tensor-parallel linear layer splits its weight ("column" on outputs, "row" on inputs); None for a plain
    nn.Linear, a refusal for anything else."""
    if isinstance(layer, nn.Linear):
        return None
    layout = getattr(getattr(layer, "weight", None), TP_LAYOUT, None)
    split = layer if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) else None
    kind = "column" if isinstance(split, ColumnParallelLinear) else "row"
    if split is None or split.transposed or not isinstance(layout, ShardLayout) or layout.dim != (0 if kind == "column" else 1):
        what = "missing" if layer is None else type(layer).__name__
        raise BehemothError(
            f"adapter layer {name} is {what} in this model: batched adapters apply to its linear layers (whole or split by --tp)",
            "use the adapters' own base model, or merge one with --adapter DIR",
        )
    return kind, layout, split.tp if kind == "row" else None


def elsewhere(name: str, blocks: str, held: set[str]) -> bool:
    """Whether module `name` is inside a block of the list `blocks` that this rank does not hold."""
    return name.startswith(f"{blocks}.") and name[len(blocks) + 1 :].split(".")[0] not in held


class LoRABank:
    """The adapters of a served model: their stacked tensors per adapted layer, and the slot of each row of the step."""

    def __init__(self, module: nn.Module, folders: dict[str, str], *, blocks: str | None = None) -> None:
        """`blocks`: under a pipeline, the name of the model's block list, of which this rank holds its stages' blocks
        only (`StageBlocks`): an adapter layer inside a block held by another rank is that rank's to adapt."""
        self.names = tuple(folders)
        adapters = [read_adapter(folder) for folder in folders.values()]
        layers = dict(module.named_modules())
        held = None if blocks is None else set(dict(module.get_submodule(blocks).named_children()))
        self.rows: torch.Tensor | None = None  # [B] slot per row (0: the base), set by the runner before each forward
        self.handles, self.bytes = [], 0
        for name in sorted({m for a in adapters for m in a.modules()}):
            layer = layers.get(name)
            if layer is None and held is not None and elsewhere(name, cast(str, blocks), held):
                continue  # another stage's block
            split = tensor_split(layer, name)
            assert layer is not None
            A, B = stacked(adapters, name, layer.weight.detach(), None if split is None else (split[0], split[1]))
            self.bytes += A.numel() * A.element_size() + B.numel() * B.element_size()
            self.handles.append(layer.register_forward_hook(self._hook(A, B, None if split is None else split[2])))

    def slot(self, name: str) -> int:
        """The slot of adapter `name` (1-based; 0 is the base)."""
        return 1 + self.names.index(name)

    def _hook(self, A: torch.Tensor, B: torch.Tensor, tp: TPComm | None):
        """The forward hook adding each row's delta; `tp`: a row-parallel layer's group, over which A x is summed."""

        def add_deltas(layer: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            rows = self.rows
            if rows is None:
                return None
            x = inputs[0]
            a, b = A[rows], B[rows]  # [B, r, in], [B, out, r]
            h = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), a.transpose(1, 2))
            h = h if tp is None else reduce_from_tp(h.contiguous(), tp)
            return out + torch.bmm(h, b.transpose(1, 2)).view_as(out)

        return add_deltas

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
