"""int4 weight-only quantization, group-wise: every linear weight as 4-bit integers, two per byte, one float scale per
group of `group` consecutive input channels of each output channel (GPTQ / AWQ's storage layout, round-to-nearest).

Symmetric per group: scale = max |w| / 7, q = clamp(round(w / scale), -8, 7), stored as q + 8 in a nibble. As with
int8 (quantize.py), a forward pre-hook rebuilds the layer's float weight just before it runs and a forward hook
drops it after, so the model holds half a byte per weight plus 4 / group bytes of scales, and one layer's float
weight at a time. A layer whose input channels the group does not divide uses one group per output channel.
Embeddings, norms and a head tied to the embedding stay in floating point. Under tensor parallelism a row-parallel
shard's groups are its own input channels: one process's groups when the shard width is a multiple of the group.
torchao's int4 weight-only kernels need CUDA (tinygemm) or an XPU/NPU here, so behemoth writes this small version.
"""

from __future__ import annotations

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.inference.quantize import QuantStats, _output_dim, install_quantized, quantizable, release_freed_memory

INT4 = "_behemoth_int4"


def quantize_int4_tensor(w: torch.Tensor, out_dim: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [out, in / 2]: two nibbles a byte, float32 scales [out, in / group]) of `w` whose outputs run along `out_dim`."""
    W = (w if out_dim == 0 else w.t()).detach().float()
    out, inputs = W.shape
    groups = W.reshape(out, inputs // group, group)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 7.0
    q = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.uint8).reshape(out, inputs)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale.squeeze(-1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, out_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight of `quantize_int4_tensor`'s output, in its original orientation."""
    out, groups = scale.shape
    q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(out, groups, -1).to(torch.float32) - 8.0
    W = (q * scale.unsqueeze(-1)).reshape(out, -1).to(dtype)
    return (W if out_dim == 0 else W.t()).contiguous()


def group_for(inputs: int, group: int) -> int | None:
    """The group size a layer of `inputs` input channels uses: `group`, or the whole row, or None (odd: kept float)."""
    if inputs % group == 0 and group % 2 == 0:
        return group
    return inputs if inputs % 2 == 0 else None


def _rebuild(module: nn.Module, _args: tuple) -> None:
    packed, scale, out_dim, dtype = getattr(module, INT4)
    module.weight = dequantize_int4(packed, scale, out_dim, dtype)


@torch.no_grad()
def quantize_int4(module: nn.Module, *, transposed: frozenset[str] = frozenset(), group: int = 64, skip: tuple[str, ...] = ()) -> QuantStats:
    """Quantize every linear weight of `module` to group-wise int4 (but those under `skip`, and weights an embedding shares)."""
    if group < 2 or group % 2:
        raise BehemothError(f"an int4 group of {group} input channels", "use an even group size of at least 2 (e.g. 64 or 128)")
    stats = QuantStats()
    for name, layer, w in quantizable(module, transposed, skip):
        out_dim = _output_dim(layer, name, transposed)
        size = group_for(w.shape[1 - out_dim], group)
        if size is not None:
            packed, scale = quantize_int4_tensor(w, out_dim, size)
            install_quantized(layer, INT4, (packed, scale, out_dim, w.dtype), _rebuild, stats)
        del w
    release_freed_memory()
    return stats
