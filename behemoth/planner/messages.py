"""The pipeline's messages: one activation (or its gradient) per micro-batch between adjacent stages, how long one
takes on the link the stages span, and how many of them a stage waits out in line with its passes."""

from __future__ import annotations

from behemoth.errors import BehemothError
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.layout import Layout, Workload


def pipeline_message_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of one activation (or its gradient) between adjacent pipeline stages (0 without a pipeline): a sequence
    shard under SP (a 2-D grid rank's block: 1/tp too); under `p2p_split` (Megatron-LM's scatter/gather, Narayanan et
    al. 2021 Section 4.1; DeepSpeed's partitioned pipeline activations) each tp rank's 1/tp and the all-gather that
    rebuilds it within the node. Where ranks outnumber cores, the receiving rank's wait for a core
    (`ClusterSpec.wake_seconds`) is part of every message."""
    if lay.pp == 1:
        return 0.0
    message = lay.tokens(work.seq_len) * work.census.shape.d_model * work.act_bytes
    link, wake = cluster.link(lay.world), cluster.wake_seconds
    if lay.seq_split:  # a sequence shard (SP) or a 2-D rank's block: each tp rank sends its 1/tp to its peer
        return link.seconds("p2p", message / lay.tp, 2) + wake
    if work.p2p_split and lay.tp > 1:
        return link.seconds("p2p", message / lay.tp, 2) + cluster.collective("all_gather", message, lay.tp) + wake
    return link.seconds("p2p", message, 2) + wake


P2P_INLINE = ("none", "batched", "separate")


def inline_transfers(work: Workload, lay: Layout, stage: int) -> int:
    """Pipeline transfers stage `stage` waits out in each of its passes when they run in line with the computation:
    none (behemoth's runtime posts them beside its passes); `batched` (Megatron-LM 2021: a send and a receive in one
    `batch_isend_irecv`, then a device synchronize, p2p_communication.py), one per pass; `separate` (DeepSpeed's
    pipeline engine: each send and receive a broadcast on a two-rank group, runtime/pipe/p2p.py), one per neighbour."""
    if work.p2p_inline not in P2P_INLINE:
        raise BehemothError(f"p2p_inline={work.p2p_inline!r} is not one of {', '.join(P2P_INLINE)}", "write none, batched or separate")
    if lay.pp == 1 or work.p2p_inline == "none":
        return 0
    neighbours = (stage > 0) + (stage < lay.stages - 1)
    return neighbours if work.p2p_inline == "separate" else min(1, neighbours)
