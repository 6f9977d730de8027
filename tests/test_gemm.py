"""train.gemm: oneDNN's float32 linears equal the BLAS's (products, gradients, and whole training runs on one process,
data parallel, ZeRO-3, tensor parallel, LoRA, transformers' Llama and GPT-2, the chunked and fused head); `auto` measures
once and never takes oneDNN off the CPU or off float32."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from behemoth.models import gemm
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

pytestmark = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch has no oneDNN")

LLAMA = ["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"]
GPT2 = ["model=hf:gpt2", "model.n_layer=2", "model.tie_embeddings=true", "model.vocab_size=257", "model.context=64"]


@pytest.fixture
def mode():
    """Restore the process's setting after a test that changes it."""
    before = gemm.gemm_mode()
    yield gemm.set_gemm
    gemm.set_gemm(before)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_float64(mode, transposed, bias):
    """Output and all three gradients within float32 rounding of a float64 reference, by the oneDNN Function."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 96, dtype=torch.float64, generator=g)
    w = torch.randn(*((96, 80) if transposed else (80, 96)), dtype=torch.float64, generator=g)
    b = torch.randn(80, dtype=torch.float64, generator=g) if bias else None
    grad = torch.randn(3, 40, 80, dtype=torch.float64, generator=g)
    leaves64 = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    leaves32 = [t.float().requires_grad_() for t in (x, w, b) if t is not None]
    ref_fn = (lambda x, w, b=None: x @ w + (0 if b is None else b)) if transposed else F.linear
    ours = gemm.linear_transposed if transposed else gemm.linear
    y64 = ref_fn(*leaves64)
    y64.backward(grad)
    mode("onednn")
    y32 = ours(*leaves32)
    assert "_OnednnLinearBackward" in str(y32.grad_fn.next_functions)
    y32.backward(grad.float())
    for got, ref in zip([y32] + [t.grad for t in leaves32], [y64] + [t.grad for t in leaves64]):
        assert got.shape == ref.shape
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("transposed", [False, True])
def test_compiled_linear_takes_onednn_and_matches_float64(mode, transposed, monkeypatch):
    """Inside torch.compile `linear` is the custom operator: dynamo traces it whole (fullgraph), and its forward and both
    backward products run by oneDNN, within float32 rounding of float64 (aot_eager: the graphs inductor would receive,
    without its minutes of code generation; the inductor path runs in test_compile's slow tests)."""
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(2, 24, 48, dtype=torch.float64, generator=g), torch.randn(2, 24, 40, dtype=torch.float64, generator=g)
    w = torch.randn(*((48, 40) if transposed else (40, 48)), dtype=torch.float64, generator=g)
    b = torch.randn(40, dtype=torch.float64, generator=g)
    ours = gemm.linear_transposed if transposed else gemm.linear
    leaves64, leaves32 = [t.clone().requires_grad_() for t in (x, w, b)], [t.float().requires_grad_() for t in (x, w, b)]
    ((leaves64[0] @ leaves64[1] + leaves64[2]) if transposed else F.linear(*leaves64)).backward(grad)
    calls = [0]
    dnn = gemm._dnn

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return dnn(*args)

    monkeypatch.setattr(gemm, "_dnn", counted)
    mode("onednn")
    torch._dynamo.reset()
    y32 = torch.compile(ours, backend="aot_eager", fullgraph=True)(*leaves32)
    y32.backward(grad.float())
    torch._dynamo.reset()  # the graphs (and the fake tensors they traced with) freed for the tests after this one
    assert calls[0] == 3  # forward, input gradient, weight gradient
    for got, ref in zip([t.grad for t in leaves32], [t.grad for t in leaves64]):
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_mm_and_matmul_take_transposed_views(mode):
    mode("onednn")
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 48, generator=g), torch.randn(32, 64, generator=g)
    assert torch.allclose(gemm.mm(a.t(), b.t()), a.t() @ b.t(), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 5, 48, generator=g)
    assert torch.allclose(gemm.matmul(x, a.t()), x @ a.t(), rtol=1e-5, atol=1e-5)


def test_only_cpu_float32_outside_autocast_takes_onednn(mode):
    w = torch.zeros(4, 8)
    mode("onednn")
    assert gemm.takes_onednn(torch.zeros(2, 8), w)
    assert not gemm.takes_onednn(torch.zeros(2, 8, dtype=torch.float64), w.double())
    assert not gemm.takes_onednn(torch.zeros(2, 8, dtype=torch.bfloat16), w.bfloat16())
    assert not gemm.takes_onednn(torch.zeros(2, 8, device="meta"), w.to("meta"))  # any device but the CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.takes_onednn(torch.zeros(2, 8), w)
    y = gemm.linear(torch.zeros(2, 8, dtype=torch.float64, requires_grad=True), w.double())
    assert "_OnednnLinear" not in str(y.grad_fn.next_functions)
    mode("blas")
    assert not gemm.takes_onednn(torch.zeros(2, 8), w)


def test_auto_measures_once(mode):
    """auto's measurement runs once per thread count (cached) and decides by it (its time, 0.18 s here, is a
    benchmark's number, not asserted: a loaded machine would fail a bound)."""
    mode("auto")
    gemm.probe.cache_clear()
    choice = gemm.takes_onednn(torch.zeros(2, 8), torch.zeros(4, 8))
    assert gemm.takes_onednn(torch.zeros(2, 8), torch.zeros(4, 8)) == choice
    assert gemm.probe.cache_info().misses == 1
    blas_s, dnn_s = gemm.probe(torch.get_num_threads())
    assert choice == (dnn_s * gemm.PROBE_MARGIN < blas_s)
    assert ("oneDNN" if choice else "BLAS") in gemm.describe().split("(")[0]


def _agreed_choice(prefers_onednn: list[bool]) -> list[bool]:
    """On each rank: rig the probe to `prefers_onednn[rank]`, agree over the world, return what every product takes."""
    import torch.distributed as dist

    rank = dist.get_rank()
    gemm.set_gemm("auto")
    gemm.probe.cache_clear()
    fast, slow = 1.0, 2.0 * gemm.PROBE_MARGIN
    gemm.probe = lambda threads: (slow, fast) if prefers_onednn[rank] else (fast, slow)
    own = gemm.takes_onednn(torch.zeros(2, 8), torch.zeros(4, 8))
    gemm.agree(dist.group.WORLD)
    return [own, gemm.takes_onednn(torch.zeros(2, 8), torch.zeros(4, 8))]


@pytest.mark.parametrize("rank0", [True, False])
def test_ranks_of_a_job_take_rank_0s_choice(rank0):
    """auto measured apart on shared cores (rank 0 oneDNN, rank 1 the BLAS, or the reverse): after `agree` both multiply
    by rank 0's choice, which only rank 0's measurement decides."""
    got = run_ranks(2, _agreed_choice, [rank0, not rank0])
    assert got[0] == [rank0, rank0]
    assert got[1] == [not rank0, rank0]


def test_route_linears_keeps_parameters_hooks_and_names():
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4, bias=False))
    names = list(model.state_dict())
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append(out.shape))
    weight = model[0].weight
    assert gemm.route_linears(model) == 2
    assert type(model[0]) is gemm.GemmLinear and isinstance(model[2], nn.Linear)
    assert list(model.state_dict()) == names and model[0].weight is weight
    model(torch.zeros(3, 8))
    assert seen == [torch.Size([3, 16])]


def _count_onednn() -> list[int]:
    """From now on in this process, count the products oneDNN runs (in the list's one element)."""
    calls = [0]
    dnn = gemm._dnn

    def counted(*args: Any) -> torch.Tensor:
        calls[0] += 1
        return dnn(*args)

    gemm._dnn = counted
    return calls


def _train_counting(cfg: dict[str, Any]) -> dict[str, Any]:
    """train_body, counting the products oneDNN ran in this process."""
    calls = _count_onednn()
    return {**train_body(cfg), "onednn_calls": calls[0]}


def _both(world: int, tmp_path, *overrides: str) -> tuple[dict[str, Any], dict[str, Any]]:
    blas = run_ranks(world, _train_counting, tiny_config(tmp_path / "blas", "train.steps=4", "train.gemm=blas", *overrides))[0]
    dnn = run_ranks(world, _train_counting, tiny_config(tmp_path / "dnn", "train.steps=4", "train.gemm=onednn", *overrides))[0]
    assert blas["onednn_calls"] == 0 and dnn["onednn_calls"] > 0
    return blas, dnn


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((), id="gpt"),
        pytest.param(("train.loss_chunk=64",), id="gpt-chunked-head"),
        pytest.param(("train.loss_chunk=0", "model.tie_embeddings=false"), id="gpt-plain-head"),
        pytest.param(tuple(LLAMA), id="hf-llama"),
        pytest.param(tuple(GPT2), id="hf-gpt2"),
        pytest.param(("model=gpt-moe-tiny",), id="moe-dropless"),
    ],
)
def test_onednn_training_equals_blas(overrides, tmp_path):
    blas, dnn = _both(1, tmp_path, *overrides)
    assert_close_runs(blas, dnn)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((), id="dp2"),
        pytest.param(("parallel.zero_stage=3",), id="zero3"),
        pytest.param(("parallel.tp=2", "parallel.sequence_parallel=true"), id="tp2-sp"),
        pytest.param((*LLAMA, "parallel.tp=2"), id="hf-llama-tp2"),
        pytest.param(("parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=2"), id="pp2-zb-h1"),
    ],
)
def test_onednn_training_equals_blas_on_two_ranks(layout, tmp_path):
    blas, dnn = _both(2, tmp_path, *layout)
    assert_close_runs(blas, dnn)


def test_onednn_zero_bubble_under_tensor_parallelism_equals_blas(tmp_path):
    """tp=2 x pp=2 under zb-h1 on 4 ranks: the deferrable row-parallel layers' outputs, summed in place over tp, train
    as the BLAS run does (their products by oneDNN once returned a view autograd refused to let the sum modify)."""
    blas, dnn = _both(4, tmp_path, "parallel.tp=2", "parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=2")
    assert_close_runs(blas, dnn)


def _lora_counting(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """LoRA fine-tuning of test_lora's folder for its batches: the losses, the final adapters, oneDNN's product count."""
    from behemoth.config import Config
    from behemoth.engine import build_engine, lr_at
    from behemoth.models.lora import adapter_parameters
    from behemoth.topology import init_runtime
    from tests.test_lora import batches

    calls = _count_onednn()
    cfg = Config.model_validate(cfg_dict)
    engine = build_engine(cfg, init_runtime(timeout_s=cfg.run.timeout_s))
    losses = [engine.train_step([(x, y)], lr_at(step, cfg.train)).loss for step, (x, y) in enumerate(batches())]
    adapters = {n: p.detach().clone() for n, p in adapter_parameters(engine.model.module).items()}
    return {"losses": losses, "weights": adapters, "onednn_calls": calls[0]}


def test_onednn_lora_equals_blas(tmp_path):
    from tests.test_lora import lora_config, save_llama

    folder = save_llama(tmp_path / "llama")
    runs = [run_ranks(1, _lora_counting, lora_config(tmp_path / m, folder, f"train.gemm={m}"))[0] for m in ("blas", "onednn")]
    assert runs[0]["onednn_calls"] == 0 and runs[1]["onednn_calls"] > 0
    assert_close_runs(*runs)


def test_the_library_choice_is_marked_as_torch_compilers_decorator_marks():
    """gemm marks its choice constant for torch.compile without importing torch._dynamo at import; the mark must be the
    public decorator's (a torch that marks otherwise fails here, not silently in a compiled graph)."""
    from behemoth.models import gemm

    def reference() -> bool:
        return True

    marked = torch.compiler.assume_constant_result(reference)
    assert vars(marked) and vars(gemm._library_chooses_onednn) == vars(marked)
