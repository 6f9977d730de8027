"""What the step-time model prices beyond products and collectives, as each published stack runs it: dropout over
materialized attention probabilities, an op-level selective checkpointing policy, eager elementwise operators, and
pipeline transfers waited out in line with the passes (split over tensor-parallel ranks)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from behemoth.config import load_config
from behemoth.planner.attention import DROPOUT_PASSES, attention_seconds
from behemoth.planner.cluster import load_cluster
from behemoth.planner.compute import block_costs, op_products
from behemoth.planner.elementwise import EAGER_BACKWARD, eager_forward_bytes, elementwise_seconds
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.messages import inline_transfers, pipeline_message_seconds
from behemoth.planner.steptime import pass_costs

LLAMA = ["model=hf:llama", "model.context=512", "model.n_layer=4", "model.d_model=256", "model.n_head=8", "hf.kv_heads=2", "hf.ffn=640"]
RUN = ["train.seq_len=512", "train.global_batch=8", "train.precision=bf16"]


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-80gb")


def with_device(cluster, **fields):
    return cluster.model_copy(update={"device": cluster.device.model_copy(update=fields)})


def test_dropout_adds_two_and_a_half_passes_over_materialized_scores_only(a100):
    work = Workload.of(load_config(None, ["model=gpt2-124m", *RUN]))
    dropped = Workload.of(load_config(None, ["model=gpt2-124m", "model.dropout=0.1", *RUN]))
    assert dropped.dropout == pytest.approx(0.1) and work.dropout == 0.0
    lay = Layout(8, 1, 1, 0, False, 2, 1)
    mat = with_device(a100, attention_kernel="materialized")
    scores = 2 * 12 * 512 * 512 * 2 / (a100.device.memory_bandwidth_gbs * 1e9)  # micro-batch x heads x s x s, bf16
    for plain, with_dropout in zip(attention_seconds(work, lay, mat), attention_seconds(dropped, lay, mat)):
        assert with_dropout - plain == pytest.approx(DROPOUT_PASSES * scores, rel=1e-9)
    assert attention_seconds(dropped, lay, a100) == attention_seconds(work, lay, a100)  # flash: the mask stays on chip


def test_op_checkpointing_reruns_every_second_product_and_the_elementwise_forward(a100):
    work = Workload.of(load_config(None, [*LLAMA, *RUN]))
    op = replace(work, op_checkpointing=True)
    lay = Layout(8, 1, 1, 0, False, 1, 1)
    products = op_products(work, lay)
    assert [n for _, _, n, _ in products] == [256, 64, 64, 256, 640, 640, 256]  # q, k, v, o, gate, up, down
    dev = a100.device
    rerun = sum(dev.gemm_seconds("bf16", m, n, k, b) for b, m, n, k in products[1::2])  # k, o and up
    elementwise = elementwise_seconds(work, lay, a100)[0]
    launches = 30 * dev.op_overhead_us * 1e-6  # a GPU queues the launches while earlier kernels run: the larger counts
    assert dev.async_launch and block_costs(op, lay, a100).selective == pytest.approx(max(rerun + elementwise, launches), rel=1e-9)
    sync = with_device(a100, async_launch=False)  # a host that runs each operator itself pays both
    assert block_costs(op, lay, sync).selective == pytest.approx(rerun + elementwise + launches, rel=1e-9)
    assert block_costs(work, lay, a100).selective == 0.0
    bounds = (0, 4)
    plain, selective = pass_costs(work, lay, a100, bounds), pass_costs(op, lay, a100, bounds)
    assert selective.backward[0] - plain.backward[0] == pytest.approx(4 * block_costs(op, lay, a100).selective, rel=1e-9)
    assert selective.forward == plain.forward and selective.recompute > 0
    full = pass_costs(op, replace(lay, recompute=(0,)), a100, bounds)  # a block recomputed whole reruns everything once
    assert full.backward == pass_costs(work, replace(lay, recompute=(0,)), a100, bounds).backward


def test_eager_elementwise_counts_each_operator_through_memory(a100):
    work = Workload.of(load_config(None, [*LLAMA, *RUN]))
    lay = Layout(4, 2, 1, 0, False, 1, 1)
    d, q, kv, ffn = 256, 256 / 2, 64 / 2, 640 / 2
    rms_norm = 6 + 8 + 4 + 8 + 6 + 4  # bf16 -> f32 (read 2, write 4), pow, mean, x * rsqrt, f32 -> bf16, * weight
    rotary = 6 + 8 + 6  # to float32, the complex multiply, back to bf16
    swiglu = 4 + 6  # silu (read, write), the gate's multiply (read two, write one)
    per_token = 2 * rms_norm * d + rotary * (q + kv) + 4 * q + 2 * 6 * d + swiglu * ffn  # + transpose, residual adds
    assert eager_forward_bytes(work, lay) == pytest.approx(per_token * 512)
    eager = with_device(a100, elementwise="eager")
    forward, backward = elementwise_seconds(work, lay, eager)
    assert forward == pytest.approx(per_token * 512 / (a100.device.memory_bandwidth_gbs * 1e9))
    assert backward == pytest.approx(EAGER_BACKWARD * forward)
    fused = elementwise_seconds(work, lay, a100)
    assert fused[0] == fused[1] and forward > fused[0]  # the upcast norms and rotary move more than the saved activations


def test_inline_pipeline_transfers_wait_in_each_pass_and_split_over_tp(a100):
    cfg = load_config(None, ["model=gpt2-124m", *RUN])
    work = Workload.of(cfg)
    cluster = a100.with_nodes(16)
    lay = Layout(1, 4, 4, 1, False, 1, 8, "1f1b")
    assert [inline_transfers(replace(work, p2p_inline="separate"), lay, s) for s in range(4)] == [1, 2, 2, 1]
    assert [inline_transfers(replace(work, p2p_inline="batched"), lay, s) for s in range(4)] == [1, 1, 1, 1]
    assert [inline_transfers(work, lay, s) for s in range(4)] == [0, 0, 0, 0]
    message = 512 * 768 * 2
    whole = pipeline_message_seconds(work, lay, cluster)
    assert whole == pytest.approx(cluster.link(16).seconds("p2p", message, 2))
    split = pipeline_message_seconds(replace(work, p2p_split=True), lay, cluster)
    assert split == pytest.approx(cluster.link(16).seconds("p2p", message / 4, 2) + cluster.collective("all_gather", message, 4))
    bounds = (0, 3, 6, 9, 12)
    plain = pass_costs(work, lay, cluster, bounds)
    separate = pass_costs(replace(work, p2p_inline="separate"), lay, cluster, bounds)
    waits = [f - g for f, g in zip(separate.forward, plain.forward)]
    assert waits == pytest.approx([whole, 2 * whole, 2 * whole, whole])
    with pytest.raises(Exception, match="p2p_inline"):
        inline_transfers(replace(work, p2p_inline="sometimes"), lay, 0)
