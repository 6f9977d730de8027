"""Several LoRA adapters served over one base, unmerged, in one batch (S-LoRA / Punica style, in plain torch).

Every adapted linear layer keeps its base weight W and gets a forward hook that adds, for each row of the step,
its own adapter's (alpha / r) B A x: the adapters' A and B are stacked ([n + 1, r, in], [n + 1, out, r], slot 0 the
base: zeros; ranks padded with zeros; the scaling folded into B) and gathered per row, so one forward serves rows
of different adapters and of the base together. The scheduler tells the runner each row's slot
(`StepBatch.adapters`); a step without adapter rows runs the base alone. A row's output equals that of the model
with its adapter merged (W + (alpha / r) B A) within float32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.peft_io import Adapter, read_adapter


def stacked(adapters: list[Adapter], module: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([n + 1, r, in], [n + 1, out, r]): every adapter's A and scaled B of `module` (zeros where it has none)."""
    out_features, in_features = weight.shape
    rank = max(a.rank for a in adapters)
    A = weight.new_zeros((len(adapters) + 1, rank, in_features), dtype=torch.float32)
    B = weight.new_zeros((len(adapters) + 1, out_features, rank), dtype=torch.float32)
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
    return A.to(weight.dtype), B.to(weight.dtype)


class LoRABank:
    """The adapters of a served model: their stacked tensors per adapted layer, and the slot of each row of the step."""

    def __init__(self, module: nn.Module, folders: dict[str, str]) -> None:
        self.names = tuple(folders)
        adapters = [read_adapter(folder) for folder in folders.values()]
        layers = dict(module.named_modules())
        self.rows: torch.Tensor | None = None  # [B] slot per row (0: the base), set by the runner before each forward
        self.handles, self.bytes = [], 0
        for name in sorted({m for a in adapters for m in a.modules()}):
            layer = layers.get(name)
            if not isinstance(layer, nn.Linear):
                kind = "missing" if layer is None else type(layer).__name__
                raise BehemothError(
                    f"adapter layer {name} is {kind} in this model: batched adapters apply to its nn.Linear layers",
                    "use the adapters' own base model, or merge one with --adapter DIR",
                )
            A, B = stacked(adapters, name, layer.weight.detach())
            self.bytes += A.numel() * A.element_size() + B.numel() * B.element_size()
            self.handles.append(layer.register_forward_hook(self._hook(A, B)))

    def slot(self, name: str) -> int:
        """The slot of adapter `name` (1-based; 0 is the base)."""
        return 1 + self.names.index(name)

    def _hook(self, A: torch.Tensor, B: torch.Tensor):
        def add_deltas(layer: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            rows = self.rows
            if rows is None:
                return None
            x = inputs[0]
            a, b = A[rows], B[rows]  # [B, r, in], [B, out, r]
            return out + torch.bmm(torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), a.transpose(1, 2)), b.transpose(1, 2)).view_as(out)

        return add_deltas

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
