"""AdamW on one unit's shard, where its state lives: float32 moments, or 8-bit blockwise moments.

The shard is a flat float32 buffer holding pieces of several parameters (`ShardPiece`: where, how many,
whether it decays: matrices and embeddings do, biases and norms do not, as in the single-process run).

- `AdamFP32`: torch's own functional AdamW (foreach, fused or the for-loop: `AdamWSettings.kernel`) over the pieces, so a step is the step
  `torch.optim.AdamW` takes in memory, element for element.
- `Adam8bit`: Dettmers et al.'s 8-bit optimizers (blockwise dynamic quantization, 256 elements per block) in
  bitsandbytes' format: on a GPU through bitsandbytes' `optimizer_update_8bit_blockwise`, on the CPU through
  `blockwise8.BlockwiseAdam8` (vectorized torch, about 10x bitsandbytes' CPU path, the same stored state). Each
  parameter's moments are quantized in blocks of their own (a block never mixes a matrix and a norm), so the state
  is laid out piece by piece with each piece padded to whole blocks.

A clipping coefficient multiplies the gradient before the step, as `clip_grad_norm` does in memory. Both step a
shard in chunks of at most CHUNK elements (whole blocks), so their temporaries do not grow with the unit; the
update is elementwise (and the quantization blockwise), so chunking changes no value.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim.adamw import adamw

from behemoth.errors import BehemothError
from behemoth.parallel.sync import AdamWSettings, decays
from behemoth.parallel.zero.blockwise8 import BLOCK, AdamStep, BlockwiseAdam8
from behemoth.parallel.zero.layout import FlatLayout

EPS = 1e-8  # torch.optim.AdamW's default
CHUNK = 2**22  # elements stepped at once: Adam's temporaries stay a few times 16 MiB whatever the unit's size
StateSpec = dict[str, tuple[int, torch.dtype]]


@dataclass(frozen=True)
class ShardPiece:
    """One parameter's part of a unit's shard."""

    offset: int  # first element in the shard
    numel: int
    decay: bool  # weight decay applies (matrices, embeddings)


def shard_pieces(layout: FlatLayout, rank: int) -> list[ShardPiece]:
    """`rank`'s shard of a unit as the pieces AdamW steps, each decaying by the single-process rule."""
    return [ShardPiece(pc.shard_offset, pc.numel, decays(layout.shapes[pc.index])) for pc in layout.pieces(rank)]


def chunks(pieces: list[ShardPiece], size: int | None = None) -> list[tuple[ShardPiece, int]]:
    """Each piece cut into parts of at most `size` (default CHUNK) elements, a multiple of BLOCK, with each part's
    offset in its piece."""
    size = size or CHUNK
    out = []
    for pc in pieces:
        for at in range(0, pc.numel, size):
            out.append((ShardPiece(pc.offset + at, min(size, pc.numel - at), pc.decay), at))
    return out


def batches(pieces: list[ShardPiece], size: int | None = None) -> list[list[ShardPiece]]:
    """Consecutive parts of the same decay grouped up to `size` (default CHUNK) elements: one foreach call each."""
    size = size or CHUNK
    out: list[list[ShardPiece]] = []
    total = 0
    for part, _ in chunks(pieces, size):
        if out and out[-1][0].decay == part.decay and total + part.numel <= size:
            out[-1].append(part)
            total += part.numel
        else:
            out.append([part])
            total = part.numel
    return out


class AdamFP32:
    """AdamW with float32 moments: 8 bytes of state per element."""

    bits = 32

    def __init__(self, settings: AdamWSettings) -> None:
        self.settings = settings

    def state_spec(self, pieces: list[ShardPiece], shard_numel: int) -> StateSpec:
        return {"m": (shard_numel, torch.float32), "v": (shard_numel, torch.float32)}

    @torch.no_grad()
    def step(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], pieces: list[ShardPiece], *, lr: float, coef: float, step: int
    ) -> None:
        """One AdamW step of every piece (the optimizer's `step` count is `step` after it)."""
        if coef != 1.0:
            g.mul_(coef)
        for chosen in batches(pieces):
            views = [[t[pc.offset : pc.offset + pc.numel] for pc in chosen] for t in (p, g, state["m"], state["v"])]
            where = p.device if self.settings.kernel == "fused" else None  # the fused kernel's step counts live with the parameters
            steps = [torch.tensor(float(step - 1), device=where) for _ in chosen]
            adamw(
                *views,
                [],
                steps,
                **self.settings.kernel_flags(),
                amsgrad=False,
                beta1=self.settings.betas[0],
                beta2=self.settings.betas[1],
                lr=lr,
                weight_decay=self.settings.weight_decay if chosen[0].decay else 0.0,
                eps=EPS,
                maximize=False,
            )

    def moments(self, state: dict[str, torch.Tensor], pieces: list[ShardPiece]) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 first and second moments over the shard (for checkpoints)."""
        return state["m"], state["v"]

    def load_moments(self, state: dict[str, torch.Tensor], m: torch.Tensor, v: torch.Tensor, pieces: list[ShardPiece]) -> None:
        if state["m"].data_ptr() != m.data_ptr():
            state["m"].copy_(m)
            state["v"].copy_(v)


def bitsandbytes_functional() -> Any:
    """bitsandbytes' functional module, or a one-line refusal naming the extra that installs it."""
    import logging

    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")  # it warns about a 4-bit matmul kernel behemoth does not use
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # its import uses deprecated torch.jit decorators
            warnings.simplefilter("ignore", DeprecationWarning)
            import bitsandbytes.functional as bnb_f
    except ImportError:
        raise BehemothError(
            "offload.optimizer_bits=8 needs bitsandbytes, which is not installed",
            'install it with pip install -e ".[offload]", or use offload.optimizer_bits=32',
        ) from None
    finally:
        quiet.setLevel(level)
    return bnb_f


def block_offsets(pieces: list[ShardPiece]) -> list[int]:
    """Where each piece's moments start in the 8-bit state: every piece padded to whole blocks."""
    out, at = [], 0
    for pc in pieces:
        out.append(at)
        at += math.ceil(pc.numel / BLOCK) * BLOCK
    return out + [at]


class Adam8bit:
    """AdamW with 8-bit blockwise moments (bitsandbytes): about 2 bytes of state per element."""

    bits = 8

    def __init__(self, settings: AdamWSettings, device: torch.device, kernel: Literal["auto", "torch", "bitsandbytes"] = "auto") -> None:
        """kernel: "auto" steps with bitsandbytes' kernel on a GPU and with `BlockwiseAdam8` on the CPU."""
        if kernel == "auto":
            kernel = "torch" if device.type == "cpu" else "bitsandbytes"
        if kernel == "torch" and device.type != "cpu":
            raise BehemothError(f"the torch 8-bit Adam kernel steps shards in CPU memory, not on {device}", "use kernel='bitsandbytes' there")
        self.settings, self.kernel = settings, kernel
        self.F = bitsandbytes_functional()
        self.qmap1 = self.F.create_dynamic_map(signed=True).to(device)  # signed map for the first moment
        self.qmap2 = self.F.create_dynamic_map(signed=False).to(device)  # unsigned for the second
        self.cpu = BlockwiseAdam8(self.qmap1, self.qmap2) if kernel == "torch" else None

    def state_spec(self, pieces: list[ShardPiece], shard_numel: int) -> StateSpec:
        n = block_offsets(pieces)[-1]
        return {"m": (n, torch.uint8), "v": (n, torch.uint8), "m_absmax": (n // BLOCK, torch.float32), "v_absmax": (n // BLOCK, torch.float32)}

    def _slices(self, state: dict[str, torch.Tensor], start: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        blocks = slice(start // BLOCK, (start + math.ceil(numel / BLOCK) * BLOCK) // BLOCK)
        return state["m"][start : start + numel], state["v"][start : start + numel], state["m_absmax"][blocks], state["v_absmax"][blocks]

    @torch.no_grad()
    def step(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], pieces: list[ShardPiece], *, lr: float, coef: float, step: int
    ) -> None:
        """One AdamW step of every piece (the optimizer's `step` count is `step` after it); the gradient may be scaled
        in place by `coef`."""
        for pc, start in zip(pieces, block_offsets(pieces)):
            hp = AdamStep(lr, self.settings.betas, EPS, self.settings.weight_decay if pc.decay else 0.0, step)
            if self.cpu is not None and p.dtype == g.dtype == torch.float32:  # float32 shards (others: bitsandbytes' path)
                where = slice(pc.offset, pc.offset + pc.numel)
                if coef != 1.0:
                    g[where].mul_(coef)  # as bitsandbytes' gnorm_scale: the gradient times the clipping coefficient
                self.cpu.update(p[where], g[where], *self._slices(state, start, pc.numel), hp)
            else:
                self._step_bitsandbytes(p, g, state, pc, start, hp, coef)

    def _step_bitsandbytes(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], pc: ShardPiece, start: int, hp: AdamStep, coef: float
    ) -> None:
        for part, at in chunks([pc]):
            m, v, ma, va = self._slices(state, start + at, part.numel)
            where = slice(part.offset, part.offset + part.numel)
            b1, b2 = hp.betas
            self.F.optimizer_update_8bit_blockwise(
                "adam", g[where], p[where], m, v, b1, b2, 0.0, 0.0, hp.eps, hp.step, hp.lr, self.qmap1, self.qmap2, ma, va,
                weight_decay=hp.weight_decay, gnorm_scale=coef,
            )  # fmt: skip

    def moments(self, state: dict[str, torch.Tensor], pieces: list[ShardPiece]) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized moments as float32 shards (the values the next step starts from)."""
        shard = max((pc.offset + pc.numel for pc in pieces), default=0)
        out = (torch.zeros(shard, device=state["m"].device), torch.zeros(shard, device=state["m"].device))
        for pc, start in zip(pieces, block_offsets(pieces)):
            for dst, codes, absmax, qmap in zip(
                out, self._slices(state, start, pc.numel)[:2], self._slices(state, start, pc.numel)[2:], (self.qmap1, self.qmap2)
            ):
                dst[pc.offset : pc.offset + pc.numel] = self.F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=BLOCK)
        return out

    def load_moments(self, state: dict[str, torch.Tensor], m: torch.Tensor, v: torch.Tensor, pieces: list[ShardPiece]) -> None:
        """Quantize float32 moments (from a checkpoint of any layout) into the 8-bit state."""
        for pc, start in zip(pieces, block_offsets(pieces)):
            codes_m, codes_v, absmax_m, absmax_v = self._slices(state, start, pc.numel)
            for src, codes, absmax, qmap in ((m, codes_m, absmax_m, self.qmap1), (v, codes_v, absmax_v, self.qmap2)):
                q, qs = self.F.quantize_blockwise(src[pc.offset : pc.offset + pc.numel].contiguous(), code=qmap, blocksize=BLOCK)
                codes.copy_(q)
                absmax.copy_(qs.absmax)


def state_bytes(pieces: list[ShardPiece], shard_numel: int, bits: int) -> int:
    """Bytes of optimizer state for a shard: two float32 moments, or two 8-bit ones padded to blocks with a float32
    scale per block (the layouts `AdamFP32` and `Adam8bit` create)."""
    if bits == 32:
        return 8 * shard_numel
    n = block_offsets(pieces)[-1]
    return 2 * n + 2 * 4 * (n // BLOCK)


def make_adam(settings: AdamWSettings, bits: int, device: torch.device) -> AdamFP32 | Adam8bit:
    if bits == 32:
        return AdamFP32(settings)
    if bits == 8:
        return Adam8bit(settings, device)
    raise ValueError(f"offload.optimizer_bits={bits} is not 32 or 8")
