"""Layout-independent initialization: a parameter's values depend only on (seed, parameter name).

Models are built on the meta device. `materialize` gives every parameter its storage by drawing the
*full* tensor from a generator seeded by a stable digest of (seed, name) and keeping this rank's
part, so a tensor-parallel shard, a pipeline stage or a ZeRO shard holds exactly the values the
single-process model holds. Full tensors are drawn in fixed row blocks, each with its own seed, so
very large tensors never need to exist whole and the values do not depend on who draws them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

ROWS_PER_BLOCK = 1024

# Attribute names a parallel transform sets on a parameter whose storage is a part of a full tensor.
FULL_NAME = "_behemoth_full_name"  # the parameter's name in the single-process model
FULL_SHAPE = "_behemoth_full_shape"  # its shape there
TAKE_LOCAL = "_behemoth_take_local"  # full tensor -> this rank's part
ADAPTER = "_behemoth_adapter"  # an added parameter the model's own weights do not hold (a LoRA adapter, models/lora.py)


@dataclass(frozen=True)
class InitSpec:
    """How one parameter is initialized."""

    kind: Literal["normal", "zeros", "ones"] = "normal"
    std: float = 0.02


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from a stable digest; Python's hash() differs between processes."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def draw_full(spec: InitSpec, shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor:
    """The full float32 tensor for parameter `name` (on the CPU)."""
    if spec.kind == "zeros":
        return torch.zeros(shape)
    if spec.kind == "ones":
        return torch.ones(shape)
    if len(shape) == 0:
        return torch.randn((), generator=torch.Generator().manual_seed(stable_seed(seed, name))) * spec.std
    blocks = []
    for b in range(math.ceil(shape[0] / ROWS_PER_BLOCK)):
        rows = min(ROWS_PER_BLOCK, shape[0] - b * ROWS_PER_BLOCK)
        g = torch.Generator().manual_seed(stable_seed(seed, name, b))
        blocks.append(torch.randn((rows, *shape[1:]), generator=g))
    return torch.cat(blocks).mul_(spec.std)


def mark_partial(param: nn.Parameter, full_name: str, full_shape: tuple[int, ...], take_local: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Record that `param` holds part of the single-process parameter `full_name`."""
    setattr(param, FULL_NAME, full_name)
    setattr(param, FULL_SHAPE, tuple(full_shape))
    setattr(param, TAKE_LOCAL, take_local)


@torch.no_grad()
def materialize(module: nn.Module, *, seed: int, device: torch.device, init_spec: Callable[[str], InitSpec]) -> None:
    """Give every meta parameter its values; parameters already materialized are left alone. A parameter held in
    several places (a tied LM head) is drawn once, under its first name, and stays one parameter."""
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta parameter) -> (it, kept alive; its replacement)
    for owner_name, owner in module.named_modules():
        for pname, param in list(owner.named_parameters(recurse=False)):
            if id(param) in done:
                setattr(owner, pname, done[id(param)][1])
                continue
            if not param.is_meta:
                continue
            name = getattr(param, FULL_NAME, f"{owner_name}.{pname}" if owner_name else pname)
            shape = getattr(param, FULL_SHAPE, tuple(param.shape))
            full = draw_full(init_spec(name), shape, seed, name)
            local = getattr(param, TAKE_LOCAL, lambda t: t)(full)
            if tuple(local.shape) != tuple(param.shape):
                raise RuntimeError(f"{name}: local part has shape {tuple(local.shape)}, parameter has {tuple(param.shape)}")
            new = nn.Parameter(local.to(device=device, dtype=param.dtype).contiguous(), requires_grad=param.requires_grad)
            new.__dict__.update({k: v for k, v in param.__dict__.items() if k.startswith("_behemoth")})
            setattr(owner, pname, new)
            done[id(param)] = (param, new)
        for bname, buf in list(owner.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta:
                raise RuntimeError(f"buffer {owner_name}.{bname} is on the meta device; models must not need meta buffers")
