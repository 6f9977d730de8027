"""How an MoE layer's expert rows are computed when its experts are spread over the `ep` ranks: two layouts.

- `AllToAllExperts` (tokens to the experts, GShard / DeepSpeed): the expert-major rows go by all-to-all to the
  ranks holding their experts (uneven splits when routing is dropless: the row counts are exchanged first),
  each rank runs its E/ep experts on what it received, and a second all-to-all brings the outputs back.
  With `chunks` = c > 1 every expert's rows are cut into c parts and the c dispatches are issued at once:
  the experts compute chunk i while chunk i + 1 is still travelling (Tutel's all-to-all pipelining). Each
  row is computed by the same expert from the same weights, so the result does not depend on c.
- `GatherExperts` (the experts to the tokens): every rank all-gathers the layer's expert weights over ep,
  runs all E experts on its own rows, and the weights' gradients are reduce-scattered back to their
  owners. No token moves; it wins when a rank's tokens outweigh the experts (Tutel's r = 0 layout, ZeRO-
  style). Parameters and optimizer state stay where they are in both layouts, so a run can switch
  between them (and between chunkings) at any step without changing what it computes.
- `OwnedExperts` (inference, where every ep rank runs the same requests, so its rows are every rank's rows): each
  rank runs its own experts on their rows and the outputs are all-gathered. No token moves and no weight; a rank's
  expert work is 1/ep of the layer's (the two layouts above compute every rank's copy of the rows).

Under tensor parallelism each rank holds a slice of every expert's MLP width: the rows enter the tensor-
parallel region (f) before the experts and their partial outputs are summed over tp (g) after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from behemoth.models.moe import MoELayer, expert_ffn
from behemoth.parallel.expert.comm import EPComm, all_to_all, all_to_all_start, finish, gather_experts, gather_rows
from behemoth.parallel.tensor.comm import TPComm, copy_to_tp, reduce_from_tp


def parts(n: int, chunks: int) -> list[int]:
    """`n` rows cut into `chunks` near-equal consecutive parts (the first n % chunks one row longer)."""
    return [n // chunks + (i < n % chunks) for i in range(chunks)]


@dataclass
class ExpertCompute:
    """Runs a rank's experts (its slice of each, under tp) on expert-major rows."""

    tp: TPComm | None = None

    def __call__(self, layer: MoELayer, rows: torch.Tensor, counts: list[int], weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.tp is not None and self.tp.size > 1:
            rows = copy_to_tp(rows, self.tp)
        out = expert_ffn(rows, counts, *weights, gated=layer.spec.gated, act=layer.spec.act)
        return reduce_from_tp(out, self.tp) if self.tp is not None and self.tp.size > 1 else out


@dataclass
class AllToAllExperts:
    """Tokens to the experts: dispatch by all-to-all, this rank's experts, combine by all-to-all (`chunks` pipelined)."""

    ep: EPComm
    compute: ExpertCompute
    chunks: int = 1
    name: str = "alltoall"

    def __call__(self, layer: MoELayer, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = len(counts) // self.ep.size
        received = self.received_counts(counts, local, uniform=layer.policy.capacity_factor is not None, device=rows.device)
        c = self.chunks
        pieces = [expert_rows.split(parts(n, c)) for expert_rows, n in zip(rows.split(counts), counts)]  # [expert][chunk]
        sends = [[parts(n, c)[i] for n in counts] for i in range(c)]  # [chunk][expert]
        recvs = [[[parts(n, c)[i] for n in src] for src in received] for i in range(c)]  # [chunk][source][expert]
        out_splits = [[sum(src) for src in recv] for recv in recvs]
        flights = [all_to_all_start(torch.cat([p[i] for p in pieces]), self.ep, self.by_rank(sends[i], local), out_splits[i]) for i in range(c)]
        back = []
        for i, (arrived, flight) in enumerate(flights):  # chunk i computes while chunks after it travel
            out = self.run_local(layer, finish(arrived, flight), recvs[i])
            back.append(all_to_all_start(out, self.ep, out_splits[i], self.by_rank(sends[i], local)))
        returned = [finish(out, flight).split(sends[i]) for i, (out, flight) in enumerate(back)]  # [chunk][expert]
        return torch.cat([returned[i][e] for e in range(len(counts)) for i in range(c)])

    def by_rank(self, counts: list[int], local: int) -> list[int]:
        return [sum(counts[j * local : (j + 1) * local]) for j in range(self.ep.size)]

    def received_counts(self, counts: list[int], local: int, *, uniform: bool, device: torch.device) -> list[list[int]]:
        """Rows each rank sends for each of this rank's experts ([source][local expert]). With a capacity every rank
        sends the same G x C rows per expert; dropless, the counts are exchanged (one small all-to-all)."""
        mine = counts[self.ep.rank * local : (self.ep.rank + 1) * local]
        if uniform or self.ep.size == 1:
            return [list(mine)] * self.ep.size
        sent = torch.tensor(counts, dtype=torch.int64, device=device)
        got = all_to_all(sent.view(self.ep.size, local), self.ep, [1] * self.ep.size, [1] * self.ep.size)
        return got.tolist()

    def run_local(self, layer: MoELayer, arrived: torch.Tensor, recv: list[list[int]]) -> torch.Tensor:
        """This rank's experts on rows arranged [source][local expert]; the outputs in the same arrangement."""
        local = len(recv[0])
        flat = [n for src in recv for n in src]
        by_source = arrived.split(flat)
        grouped = torch.cat([by_source[s * local + e] for e in range(local) for s in range(len(recv))])
        expert_counts = [sum(src[e] for src in recv) for e in range(local)]
        out = self.compute(layer, grouped, expert_counts, layer.expert_weights()).split([src[e] for e in range(local) for src in recv])
        return torch.cat([out[e * len(recv) + s] for s in range(len(recv)) for e in range(local)])


@dataclass
class GatherExperts:
    """Experts to the tokens: all-gather the layer's expert weights over ep, run every expert here, reduce-scatter back."""

    ep: EPComm
    compute: ExpertCompute
    name: str = "gather"

    def __call__(self, layer: MoELayer, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w_in, w_out = layer.expert_weights()
        return self.compute(layer, rows, counts, (gather_experts(w_in, self.ep), gather_experts(w_out, self.ep)))


@dataclass
class OwnedExperts:
    """Rows alike on every ep rank (inference): this rank's experts on their rows, the outputs all-gathered over ep."""

    ep: EPComm
    compute: ExpertCompute
    name: str = "owned"

    def __call__(self, layer: MoELayer, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        local = len(counts) // self.ep.size
        per_rank = [sum(counts[j * local : (j + 1) * local]) for j in range(self.ep.size)]
        start, mine = sum(per_rank[: self.ep.rank]), counts[self.ep.rank * local : (self.ep.rank + 1) * local]
        out = self.compute(layer, rows[start : start + per_rank[self.ep.rank]], mine, layer.expert_weights())
        return gather_rows(out, self.ep, per_rank)
