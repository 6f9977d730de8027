"""What an MoE block saves for backward beyond the dense block `models/activations` counts, on one rank.

The census counts every block as dense (its MLP's hidden activations, `split`); an MoE MLP instead saves, per token,
the router's float32 logits and probabilities (2E) and, for each of the rows it routes (`Workload.routed_rows`: k per
token dropless, capacity_factor x k slots with a capacity), the gathered input row and the output rows before and
after their gate (3h, whole on every tensor-parallel rank: the layer runs whole there), the expert's hidden
activations (the dense MLP's, of the expert's 1/t of its width) and the dispatch's indices and gate (11 float32-sized
elements). Under sequence parallelism the layer runs on the gathered sequence (`sequence_replicate`): the router's
input is the full sequence's, where the dense block's MLP input is a shard. Measured with `profiler/measure` for GPT
(dropless, h in {64, 128}, E in {4, 8}, k in {1, 2}, t in {1, 2}, with and without SP), within 0.1% of the stash:

    extra per token = k (3h + hidden x ffn / t + 11) + 2E - 3 - hidden x ffn / t  (+ h (1 - 1/t) under SP)

A model whose MoE blocks alternate with dense ones (`model.moe.every`) adds the mean over its blocks.
"""

from __future__ import annotations

from behemoth.models.activations import STANDARD_LAYOUT
from behemoth.planner.layout import Layout, Workload

DISPATCH_ELEMENTS = 11  # per routed row: source and assignment indices (int64), the gate, the sort (float32-sized elements)
ROUTER_OFFSET = -3  # per token: what the dense block counts that the router does not save (fitted)


def hidden_per_ffn(work: Workload) -> int:
    """MLP-width tensors one MLP saves per token: GELU's input and output (gpt), transformers' tanh GELU's five (gpt2),
    SwiGLU's gate, up, SiLU and product (the standard layout)."""
    shape = work.census.shape
    if shape.arch in STANDARD_LAYOUT:
        return 4
    return 5 if shape.arch == "gpt2" else 2


def moe_share(work: Workload) -> float:
    """The share of the model's blocks whose MLP is an MoE layer."""
    experts = work.census.shape.experts
    return sum(1 for e in experts if e) / len(experts) if experts else 0.0


def moe_saved_elements(work: Workload, lay: Layout, tokens: int) -> float:
    """Elements one block saves beyond the dense count for `tokens` tokens on one rank, averaged over the blocks."""
    share = moe_share(work)
    if not share:
        return 0.0
    shape, t = work.census.shape, lay.tp
    hidden = hidden_per_ffn(work) * shape.ffn / t
    experts = max(e for e in shape.experts if e)
    per_token = work.routed_rows * (3 * shape.d_model + hidden + DISPATCH_ELEMENTS) + 2 * experts + ROUTER_OFFSET - hidden
    if lay.sp and t > 1:
        per_token += shape.d_model * (1 - 1 / t)
    return share * per_token * tokens


GRADIENT_COPIES = 4  # stacked expert gradients alive at once in an MoE block's backward (measured: 3.9 to 4.0 copies)


def moe_backward_working(work: Workload, lay: Layout, grad_bytes: int) -> float:
    """An MoE block's backward transient: each expert's weight gradient comes out of its slice of the stacked weight
    as a full stacked tensor (`w_in[e]`'s backward), summed as they arrive, so about four stacked gradients of this
    rank's E / ep experts (1/t of each one's width) are alive at once (measured, as above)."""
    shape = work.census.shape
    if not moe_share(work):
        return 0.0
    experts = max(e for e in shape.experts if e) / lay.ep
    stacked = experts * (2 if shape.gated else 1) * shape.ffn / lay.tp * shape.d_model
    return GRADIENT_COPIES * grad_bytes * stacked
