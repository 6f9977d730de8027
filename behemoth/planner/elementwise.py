"""What one block's elementwise operators cost one rank for one micro-batch: their bytes through memory.

- **Fused** (`device.elementwise: fused`, the default: Megatron-LM's fused LayerNorm, bias-GeLU, bias-dropout-add and
  scale-mask-softmax kernels): each saved activation element written once and read about once more, in forward and
  again in backward.
- **Eager** (`device.elementwise: eager`: PyTorch without torch.compile, as torchtitan's 2024 tables ran): every
  operator reads its inputs from memory and writes its output, counted per operator of the family's block (bytes per
  element, activations of `a` bytes, float32 where the model upcasts):
  a gated family (Llama: RMSNorm, rotary, SwiGLU, as Meta's reference model and torchtitan's `RMSNorm` write them)
  - RMSNorm, twice per block, over d: `x.float()` (a + 4), `pow(2)` (8), `mean` (4), `x * rsqrt` (8), `type_as`
    (4 + a), `* weight` (2a): 28 + 4a;
  - rotary on q and k: `float()` (a + 4), the complex multiply (8), `type_as` (4 + a): 16 + 2a;
  a GPT block: LayerNorm twice (one kernel: 2a), GELU on the MLP width (2a); either family: the attention output
  back to token-major (`transpose(1, 2).contiguous()`, 2a over q), two residual adds (3a each over d), the SwiGLU's
  `silu` and gate multiply (5a over the MLP width). A pointwise operator's backward reads the output gradient and one
  saved input and writes the input gradient, so backward moves `EAGER_BACKWARD` times its forward's bytes.
"""

from __future__ import annotations

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.layout import Layout, Workload

ELEMENTWISE_PASSES = 2.0  # fused: each saved activation element is written once and read about once more in forward
EAGER_BACKWARD = 2.0  # eager: a pointwise backward reads the gradient and an input and writes a gradient, its forward reads and writes one


def eager_forward_bytes(work: Workload, lay: Layout) -> float:
    """Bytes one block's eager elementwise operators move in forward, on one rank, for one micro-batch."""
    shape, t, a = work.census.shape, lay.tp, work.act_bytes
    hidden = shape.d_model / (t if lay.seq_split else 1)  # norms and residual adds see the whole hidden state (its shard under SP)
    q, kv, ffn = shape.q_width / t, shape.kv_width / t, shape.ffn / t
    if shape.gated:
        norms, rotary, mlp = 2 * (28 + 4 * a) * hidden, (16 + 2 * a) * (q + kv), 5 * a * ffn
    else:
        norms, rotary, mlp = 2 * 2 * a * hidden, 0.0, 2 * a * ffn
    per_token = norms + rotary + 2 * a * q + 2 * 3 * a * hidden + mlp
    return per_token * lay.tokens(work.seq_len)


def elementwise_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, input-gradient pass) seconds of one block's elementwise traffic at the device's memory bandwidth."""
    bandwidth = cluster.device.memory_bandwidth_gbs * 1e9
    if cluster.device.elementwise == "eager":
        forward = eager_forward_bytes(work, lay) / bandwidth
        return forward, EAGER_BACKWARD * forward
    saved = work.census.activations.elements(lay.tokens(work.seq_len), lay.tp, lay.seq_split) * work.act_bytes
    fused = ELEMENTWISE_PASSES * saved / bandwidth
    return fused, fused
