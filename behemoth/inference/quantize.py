"""int8 weight-only quantization: every linear weight kept as int8 with one float scale per output channel.

`quantize_int8(module, transposed=...)` replaces the weight of each linear layer (nn.Linear, a model's
transposed linears such as GPT-2's Conv1D, behemoth's tensor-parallel column/row layers) by an int8
tensor and its per-output-channel scales (symmetric: scale = max |w| / 127 over the channel). Just before
the layer runs, a forward pre-hook rebuilds its floating-point weight from them, and a forward hook drops
it again after, so the model holds 1 byte per weight (plus the scales) and one layer's float weight at a
time. Embeddings and norms stay in floating point; a head tied to the embedding stays with it. The float weights are
freed (a model laid out for inference holds no other reference to them) and given back to the system.

Weight-only int8 saves memory (and, on accelerators with int8 kernels, bandwidth); on a CPU the rebuild
costs time. torchao 0.18's int8 weight-only tensors install and run here on nn.Linear (and on layers that call
F.linear), but not on GPT-2's transposed Conv1D (its Int8Tensor implements no addmm) nor on the transposed
tensor-parallel layers built from it, so behemoth writes this small version that covers every linear layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from behemoth.parallel.tensor.comm import TPComm
from behemoth.parallel.tensor.layers import RowParallelLinear, VocabParallelEmbedding

if TYPE_CHECKING:
    from behemoth.config import Config
    from behemoth.parallelize import ParallelModel

QUANTIZED = "_behemoth_int8"


@dataclass
class QuantStats:
    """What quantization changed: layers, weights, bytes before and after."""

    layers: int = 0
    weights: int = 0
    float_bytes: int = 0
    int8_bytes: int = 0


def quantize_tensor(w: torch.Tensor, out_dim: int, row_parallel: TPComm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output channel) of `w` whose output channels run along `out_dim`. A row-parallel
    shard holds part of each output channel: its maxima are taken over the whole channel (max over tp), so every rank
    quantizes exactly as one process quantizes the full weight."""
    peak = w.detach().abs().amax(dim=1 - out_dim, keepdim=True).float()
    if row_parallel is not None:
        row_parallel.all_reduce(peak, dist.ReduceOp.MAX)
    scale = peak.clamp(min=1e-12) / 127.0
    q = torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(dtype) * scale.to(dtype)).contiguous()


def is_linear(module: nn.Module, name: str, transposed: frozenset[str]) -> bool:
    """A layer whose 2-D `weight` multiplies its input: nn.Linear, a transposed linear, or a tensor-parallel linear."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or isinstance(module, nn.Embedding):
        return False
    return isinstance(module, nn.Linear) or name in transposed or isinstance(getattr(module, "transposed", None), bool)


def _output_dim(module: nn.Module, name: str, transposed: frozenset[str]) -> int:
    """Output channels of the weight: dimension 0 of [out, in], 1 of a transposed [in, out]."""
    return 1 if (name in transposed or getattr(module, "transposed", False) is True) else 0


def _rebuild(module: nn.Module, _args: tuple) -> None:
    q, scale, dtype = getattr(module, QUANTIZED)
    module.weight = dequantize(q, scale, dtype)


def _drop(module: nn.Module, _args: tuple, _out: object) -> None:
    module.weight = None  # the float weight lives only while the layer runs


def quantizable(module: nn.Module, transposed: frozenset[str], skip: tuple[str, ...]) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """The linear layers of `module` to quantize, with their weights: all but those under a `skip` prefix and those
    whose weight an embedding shares (a tied head stays in floating point with its embedding)."""
    shared = {id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    for name, layer in list(module.named_modules()):
        if is_linear(layer, name, transposed) and not name.startswith(skip) and id(layer.weight) not in shared:
            yield name, layer, cast(torch.Tensor, layer.weight)


def install_quantized(layer: nn.Module, attr: str, stored: tuple, rebuild: Callable[[nn.Module, tuple], None], stats: QuantStats) -> None:
    """Replace `layer`'s float weight by `stored` (its quantized tensors first, then anything `rebuild` needs), rebuilt
    by `rebuild` just before the layer runs and dropped after; the bytes of the stored tensors are counted."""
    w = cast(torch.Tensor, layer._parameters.pop("weight"))
    setattr(layer, attr, stored)
    layer.weight = None
    layer.register_forward_pre_hook(rebuild)
    layer.register_forward_hook(_drop)
    stats.layers += 1
    stats.weights += w.numel()
    stats.float_bytes += w.numel() * w.element_size()
    stats.int8_bytes += sum(t.numel() * t.element_size() for t in stored if isinstance(t, torch.Tensor))


@torch.no_grad()
def quantize_int8(module: nn.Module, *, transposed: frozenset[str] = frozenset(), skip: tuple[str, ...] = ()) -> QuantStats:
    """Quantize every linear weight of `module` (but those under a `skip` prefix, and weights shared with an embedding)."""
    stats = QuantStats()
    for name, layer, w in quantizable(module, transposed, skip):
        q, scale = quantize_tensor(w, _output_dim(layer, name, transposed), layer.tp if isinstance(layer, RowParallelLinear) else None)
        install_quantized(layer, QUANTIZED, (q, scale, w.dtype), _rebuild, stats)
        del w
    release_freed_memory()
    return stats


def release_freed_memory() -> int:
    """Give the float weights just freed back to the system. glibc's malloc keeps freed chunks inside its heap (a weight
    allocated after a larger buffer was freed comes from the heap, not its own mapping), so without a trim the process
    stays as large as before quantization. 1 if memory was returned, 0 if not (or no glibc)."""
    try:
        return int(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator returns memory its own way
        return 0


@torch.no_grad()
def validation_loss(model: ParallelModel, cfg: Config, *, batches: int = 4, batch_size: int = 8) -> float:
    """Mean token loss of a (single-process) model on its run's validation split: the number quantization may change."""
    from behemoth.data import BatchLayout, BatchSampler
    from behemoth.models.causal_lm import counted_targets

    split = cfg.corpus_split(cfg.prepare_corpus(), "val")  # tokenized (and masked) as the run was trained
    sampler = BatchSampler(split, cfg.seq_len, BatchLayout(batch_size, batch_size, 1), 0, cfg.train.seed, stream=1)
    total, count = 0.0, 0
    for step in range(batches):
        for inputs, targets in sampler.micro_batches(step):
            total += float(model.loss_sum(model.logits(inputs), targets.to(model.rt.device)))
            count += int(counted_targets(targets))
    return total / count
