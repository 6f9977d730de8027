"""Pipeline-parallel generation: a step's requests cut into micro-batches that flow through the stages.

Every rank holds its stages' blocks and their part of the KV cache. A step's rows (requests) are cut
into up to `pp` micro-batches that run through the pipeline executor's forward-only pass (`flow`, the
one evaluation uses): stage s runs micro-batch j while stage s+1 runs micro-batch j-1, each stage
sending its hidden states on as soon as they exist (bounded waits). The last stage turns each
micro-batch's last hidden states into logits (gathered over tensor parallelism within the stage) and
sends the step's logits back to the first stage, where the scheduler samples. `verify` (speculative decoding's check)
sends back the logits after every new token of each row instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from behemoth.comm import P2P, batch_p2p
from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import StepBatch
from behemoth.inference.runner import KVMove, ModelRunner
from behemoth.parallel.pipeline.partition import PipelineStage
from behemoth.parallelize import ParallelModel

LOGITS_TAG = 1 << 20


def split_rows(batch: StepBatch, parts: int) -> list[StepBatch]:
    """The batch's rows in `parts` contiguous micro-batches (as even as possible), each with its own slots."""
    B = batch.ids.shape[0]
    bounds = [round(i * B / parts) for i in range(parts + 1)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), batch.lengths.cumsum(0)])
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        T = int(batch.lengths[lo:hi].max())
        L = int((batch.positions[lo:hi].max(dim=1).values + 1).max())
        out.append(
            StepBatch(
                batch.ids[lo:hi, :T],
                batch.positions[lo:hi, :T],
                batch.lengths[lo:hi],
                batch.slots[offsets[lo] : offsets[hi]],
                batch.gather[lo:hi, :L],
                None if batch.adapters is None else batch.adapters[lo:hi],
            )
        )
    return out


class PipelineRunner:
    """This rank's stages of a pipelined model; `forward` is collective over the pipeline (every rank calls it)."""

    def __init__(self, model: ParallelModel, local: ModelRunner, *, timeout_s: float = 300.0) -> None:
        pipe = model.pipeline
        if pipe is None or pipe.executor is None:
            raise BehemothError("pipelined generation of a model laid out without a pipeline", "load the model with pp > 1")
        self.local, self.group, self.timeout_s, self.executor = local, pipe.group, timeout_s, pipe.executor
        self.size = dist.get_world_size(self.group)
        owners = self.executor.schedule.stage_ranks
        self.first, self.last = owners[0][0], owners[-1][0]  # the pipeline ranks of the embedding and of the head
        self.is_first, self.is_last = self.executor.rank == self.first, self.executor.rank == self.last
        self.sends_logits = model.rt.coordinate("tp") == 0  # one copy of the step's logits goes back per pipeline
        self.vocab_size, self.device = local.vocab_size, model.rt.device

    def forward(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits [B, vocab] of each row's last new token on the first stage; None on the others."""
        parts = split_rows(batch, min(self.size, batch.ids.shape[0]))

        def stage_forward(stage: PipelineStage, j: int, x: torch.Tensor) -> torch.Tensor:
            h = self.local.hidden(parts[j], None if stage.is_first else x, layers=stage.blocks)
            return self.local.head(h, parts[j].lengths) if stage.is_last else h

        logits = self.executor.flow([mb.ids for mb in parts], stage_forward)
        return self._logits_home([logits[j] for j in sorted(logits)], (batch.ids.shape[0], self.vocab_size))

    def verify(self, batch: StepBatch) -> torch.Tensor | None:
        """Logits [B, T, vocab] after every new token (speculative decoding's check) on the first stage; None on the others."""
        parts = split_rows(batch, min(self.size, batch.ids.shape[0]))
        B, T = batch.ids.shape

        def stage_forward(stage: PipelineStage, j: int, x: torch.Tensor) -> torch.Tensor:
            h = self.local.hidden(parts[j], None if stage.is_first else x, layers=stage.blocks)
            if not stage.is_last:
                return h
            logits = self.local.every_logits(h)  # [B_j, T_j, V]: padded to the step's T
            return torch.nn.functional.pad(logits, (0, 0, 0, T - logits.shape[1]))

        logits = self.executor.flow([mb.ids for mb in parts], stage_forward)
        return self._logits_home([logits[j] for j in sorted(logits)], (B, T, self.vocab_size))

    def _logits_home(self, logits: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
        """The last stage's logits (of `shape`), sent to the first (a one-stage pipeline keeps them)."""
        if self.is_first and self.is_last:
            return torch.cat(logits)
        if self.is_last and self.sends_logits:
            for pending in batch_p2p([P2P(True, torch.cat(logits).contiguous(), self.first, LOGITS_TAG)], self.group):
                pending.wait(self.timeout_s)
            return None
        if self.is_first and self.sends_logits:
            out = torch.empty(shape, dtype=torch.float32, device=self.device)
            for pending in batch_p2p([P2P(False, out, self.last, LOGITS_TAG)], self.group):
                pending.wait(self.timeout_s)
            return out
        return None

    def move_kv(self, move: KVMove) -> None:
        """KV offload: this rank's stages' layers of the request (every rank of the pipeline gets the same move)."""
        self.local.move_kv(move)

    def keepalive(self) -> None:
        pass

    def close(self) -> None:
        pass
