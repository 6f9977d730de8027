"""Running one step of new tokens through a model laid out by `parallelize`: one process or tensor-parallel.

`ModelRunner.forward(batch)` runs a `StepBatch` through this rank's layers against its KV storage and
returns the logits of each row's last new token over the whole vocabulary (under tensor parallelism the
head's vocabulary shards are gathered). `DistributedRunner` is what the scheduling rank (job rank 0)
holds when the model spans several processes: it sends every step to the other ranks, which run
`follow` until it says stop, so every rank runs the same forward with its own weights and heads.
The scheduler's other calls go the same way: `verify` (speculative decoding's forward of every new position) and
`move_kv` (KV offload: each rank copies its own heads' and layers' keys and values of a preempted request to its host
memory, and back into the slots rank 0 names when it resumes), so every rank does what the one scheduler decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import all_gather, broadcast_object
from behemoth.inference.fast_decode import FusedDecoder
from behemoth.inference.kv_cache import CacheLayout, KVStorage, StepBatch
from behemoth.inference.lora_bank import LoRABank
from behemoth.inference.packed_prefill import packed_step
from behemoth.models.causal_lm import CausalLM
from behemoth.parallel.tensor import TensorParallel
from behemoth.parallel.tensor.twod import TensorParallel2D

STOP = "stop"
KEEPALIVE = "keepalive"


@dataclass(frozen=True)
class KVMove:
    """A preempted request's keys and values to this rank's host memory (offload), back into new slots (restore), or
    forgotten (drop: it ended while it waited). Every rank moves its own heads and layers of `slots`."""

    kind: Literal["offload", "restore", "drop"]
    request: int
    slots: torch.Tensor | None = None


@dataclass(frozen=True)
class Verify:
    """A step whose logits after every new token are wanted (speculative decoding's check of the proposals)."""

    batch: StepBatch


class Runner(Protocol):
    """What the scheduler drives: a forward of one step, the logits of each row's last new token."""

    vocab_size: int

    def forward(self, batch: StepBatch) -> torch.Tensor: ...

    def move_kv(self, move: KVMove) -> None: ...

    def keepalive(self) -> None: ...

    def close(self) -> None: ...


def gather_vocab(logits: torch.Tensor, tp: TensorParallel | TensorParallel2D | None, vocab_size: int) -> torch.Tensor:
    """[B, V]: the full vocabulary's logits from this rank's shard of a vocabulary-parallel head (padding cut); on a
    2-D grid the shards are the row's columns'."""
    if tp is None or tp.vocab is None or logits.shape[-1] != tp.vocab.padded:
        return logits[:, :vocab_size]
    comm = tp.grid.row_comm() if isinstance(tp, TensorParallel2D) else tp.tp
    parts = logits.new_empty((comm.size * logits.shape[0], logits.shape[1]))
    all_gather(parts, logits.contiguous(), comm.group)
    B = logits.shape[0]
    return parts.view(comm.size, B, -1).permute(1, 0, 2).reshape(B, -1)[:, :vocab_size]


def head_split(tp: TensorParallel | TensorParallel2D | None, degree: int) -> int:
    """Over how many ranks the key/value heads are split: the tp degree, or a 2-D grid's q (its columns)."""
    return tp.grid.q if isinstance(tp, TensorParallel2D) else degree


class HostKV:
    """This rank's keys and values of preempted requests, in host memory, by request id (`KVMove`)."""

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.saved: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def move(self, move: KVMove) -> None:
        if move.kind == "offload":
            assert move.slots is not None
            self.saved[move.request] = self.storage.offload(move.slots)
        elif move.kind == "restore":
            assert move.slots is not None
            self.storage.restore(move.slots, self.saved.pop(move.request))
        else:
            self.saved.pop(move.request, None)


FUSED_MAX_NEW = 16  # new tokens per row up to which a step whose rows are all full takes the one-call decode step


def fused_step(batch: StepBatch) -> bool:
    """A step for the one-call decode step (fast_decode.py): every row adds the same few tokens, none padded (decode
    steps, a speculative check of equal proposals, a draft catching up); longer prefills and padded batches run the
    model's blocks."""
    T = batch.ids.shape[1]
    return T == 1 or (T <= FUSED_MAX_NEW and bool((batch.lengths == T).all()))


class ModelRunner:
    """This rank's model (every layer it holds) and KV storage; forward of a StepBatch to the last tokens' logits."""

    packs_rows = True  # it runs packed steps (kv_cache.plan_packed_step): a prompt's chunk and the decodes in one forward

    def __init__(
        self, lm: CausalLM, storage: KVStorage, *, tp: TensorParallel | TensorParallel2D | None = None, device: torch.device | None = None
    ) -> None:
        self.lm, self.storage, self.tp = lm, storage, tp
        self.view = lm.layers  # the model's own blocks, run against the cache
        self.blocks = lm.module.get_submodule(self.view.blocks)
        self.layers = storage.layout.layers
        self.vocab_size = lm.shape.vocab_size
        self.device = device or storage.device
        self.lora: LoRABank | None = None  # adapters served unmerged (lora_bank.py)
        self.fused: FusedDecoder | None | bool = tp is None  # decode steps' one-call path (fast_decode.py); built at first use
        self.packed_prefill = True  # other steps of several tokens per row run packed on the fused weights (packed_prefill.py)
        self.split_products = False  # its batch-1 products on two threads (`CachePolicy.split_products`)
        self.decode_lanes = True  # its decode steps on dense per-request lanes (`CachePolicy.decode_lanes`)
        self.host_kv = HostKV(storage)  # preempted requests' keys and values (KV offload)
        lm.module.eval()

    @torch.no_grad()
    def hidden(self, batch: StepBatch, h: torch.Tensor | None = None, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Embed the batch's tokens (or take the hidden states `h` from an earlier stage) and run `layers` (default: this
        rank's blocks)."""
        step = self.storage.step(batch)
        model, positions = self.lm.module, step.batch.positions
        if self.lora is not None:
            self.lora.rows = step.batch.adapters
        if h is None:
            h = self.view.embed(model, step.batch.ids, positions)
        ctx = self.view.context(model, h, positions, step)
        layers = self.layers if layers is None else layers
        fused = self.fused_decoder() if self.lora is None else None
        if fused is not None and (fused_step(step.batch) or step.batch.packed is not None):
            return fused(h, ctx, layers, self.storage)
        if fused is not None and self.packed_prefill:
            return packed_step(fused, h, ctx, layers, self.storage)
        for i in layers:
            h = self.view.block(self.blocks[i], h, ctx)
        return h

    def fused_decoder(self) -> FusedDecoder | None:
        """The one-call decode step of this rank's layers, where every one is a plain Llama layer (else None, once)."""
        if self.fused is True:
            self.fused = FusedDecoder.of(cast(nn.ModuleList, self.blocks), self.layers, self.untied_head(), self.split_products)
            if self.fused is not None:
                self.fused.use_lanes = self.decode_lanes
        return self.fused or None

    def untied_head(self) -> nn.Module | None:
        """The Llama head where this rank holds it and it shares no weight with the embedding (else None)."""
        model = self.lm.module
        head = getattr(model, "lm_head", None)
        try:
            embedding = getattr(model.get_submodule(self.view.embedding), "weight", None)
        except AttributeError:  # a pipeline stage without the embedding
            embedding = None
        return None if head is None or embedding is head.weight else head

    @torch.no_grad()
    def head(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits of each row's last real token over the whole vocabulary, float32."""
        last = h[torch.arange(h.shape[0], device=h.device), lengths.to(h.device) - 1].unsqueeze(1)
        logits = self.view.head(self.lm.module, last)[:, 0]
        return gather_vocab(logits, self.tp, self.vocab_size).float()

    def forward(self, batch: StepBatch) -> torch.Tensor:
        h = self.hidden(batch)
        if batch.packed is None:
            return self.head(h, batch.lengths)
        ends = batch.packed.ends.to(h.device)  # packed sequences: the logits of each one's last new token
        return self.head(h[0, ends].unsqueeze(1), torch.ones_like(ends))

    @torch.no_grad()
    def verify(self, batch: StepBatch) -> torch.Tensor:
        """[B, T, V] float32: the logits after every new token (speculative decoding checks a draft's tokens with them)."""
        return self.every_logits(self.hidden(batch))

    @torch.no_grad()
    def every_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[B, T, V] float32: the head at every position of `h` over the whole vocabulary (shards gathered)."""
        logits = self.view.head(self.lm.module, h)
        B, T = logits.shape[:2]
        return gather_vocab(logits.reshape(B * T, -1), self.tp, self.vocab_size).reshape(B, T, -1).float()

    def move_kv(self, move: KVMove) -> None:
        self.host_kv.move(move)

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass


def cache_layout(lm: CausalLM, *, layers: tuple[int, ...], tp: int, block_size: int, num_blocks: int, dtype: torch.dtype) -> CacheLayout:
    """The paged cache of `layers` with this rank's share of the key/value heads (`CausalLM.kv_cache_shape`)."""
    _, _, kv_heads, _, head_dim = lm.kv_cache_shape(1, block_size, tp)
    return CacheLayout(layers, kv_heads, head_dim, block_size, num_blocks, dtype)


def module_dtype(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


class DistributedRunner:
    """On job rank 0: every step goes to all ranks of the job (`follow`), then runs here too."""

    def __init__(self, local: Runner, group: dist.ProcessGroup) -> None:
        self.local, self.group = local, group
        self.vocab_size = local.vocab_size
        self.packs_rows = getattr(local, "packs_rows", False)

    def _send(self, message: object) -> None:
        broadcast_object(lambda: message, self.group, is_source=True)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        self._send(batch)
        return self.local.forward(batch)

    def verify(self, batch: StepBatch) -> torch.Tensor:
        """Speculative decoding's check on every rank (a tensor-parallel model: each rank its heads, vocabulary gathered; a
        pipeline: every position's logits come back from the last stage)."""
        self._send(Verify(batch))
        return cast(ModelRunner, self.local).verify(batch)

    def move_kv(self, move: KVMove) -> None:
        self._send(move)
        self.local.move_kv(move)

    def keepalive(self) -> None:
        """Tell idle ranks the job is alive (their wait for the next step is bounded by the process-group timeout)."""
        self._send(KEEPALIVE)

    def close(self) -> None:
        self._send(STOP)


def follow(local: Runner, group: dist.ProcessGroup) -> int:
    """On every other rank: run each step job rank 0 sends until it says stop; how many steps ran."""
    steps = 0
    while True:
        message = broadcast_object(lambda: None, group, is_source=False)
        if isinstance(message, str) and message == STOP:
            return steps
        if isinstance(message, StepBatch):
            local.forward(message)
            steps += 1
        elif isinstance(message, Verify):
            cast(ModelRunner, local).verify(message.batch)
            steps += 1
        elif isinstance(message, KVMove):
            local.move_kv(message)
