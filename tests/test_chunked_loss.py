"""The chunked and the fused (chunk 0: whole, logits kept) linear + cross-entropy (models/chunked_loss.py) against the
plain head and loss: values and gradients in float32, with masked targets, at tp=1 and tp=2; training through the
engine; peak memory falls with the chunk, and the fused one holds less than the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from behemoth.models import gemm
from behemoth.models.chunked_loss import AUTO_BYTES, HEAD_INPUT, HeadInput, VocabSplit, chunk_tokens, chunked_cross_entropy_sum
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

N, D, V = 45, 16, 67  # tokens, width, vocabulary (odd: chunks and tp shards are uneven)
LIBRARIES = ["blas", "onednn"] if gemm.onednn_available() else ["blas"]  # the fused loss's logits: vocabulary- or token-major


@pytest.fixture(params=LIBRARIES)
def library(request):
    """train.gemm for the test (the fused loss lays its logits out by it), restored after."""
    before = gemm.gemm_mode()
    gemm.set_gemm(request.param)
    yield request.param
    gemm.set_gemm(before)


def _assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _deferred(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int, transposed: bool = False) -> torch.Tensor:
    out = h.view_as(h)
    setattr(out, HEAD_INPUT, HeadInput(weight, bias, transposed, torch.float32, chunk))
    return out


def _problem(seed: int, bias: bool = True) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=g).requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::4] = -100  # a chat's prompt tokens: no loss, no gradient
    targets[1], targets[2] = 0, V - 1
    return h, w, b, targets


def _grads(*ts: torch.Tensor | None) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in ts if t is not None]
    for t in ts:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk", [0, 1, 7, N, 1000])
@pytest.mark.parametrize("transposed", [False, True])
def test_equals_the_plain_loss_and_gradients(chunk, transposed, library):
    h, w, b, targets = _problem(0)
    ref = F.cross_entropy(F.linear(h, w, b), targets, reduction="sum", ignore_index=-100)
    (ref * 0.3).backward()  # the engine scales the summed loss: the incoming gradient is not 1
    expected = _grads(h, w, b)
    weight = w.detach().t().contiguous().requires_grad_() if transposed else w
    loss = chunked_cross_entropy_sum(_deferred(h, weight, b, chunk, transposed), targets)
    (loss * 0.3).backward()
    got = _grads(h, weight, b)
    _assert_close(loss, ref.detach(), "loss")
    for what, a, e in zip(("hidden", "weight", "bias"), got, expected):
        _assert_close(a.t() if what == "weight" and transposed else a, e, f"{what} gradient")


@pytest.mark.parametrize("chunk", [0, 8])
def test_every_target_masked_gives_zero_loss_and_gradient(chunk):
    h, w, _, targets = _problem(1, bias=False)
    loss = chunked_cross_entropy_sum(_deferred(h, w, None, chunk), torch.full_like(targets, -100))
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not w.grad.any()


def test_fused_backward_twice_is_refused():
    """The fused loss turns its kept logits into their gradient in place: a second backward must fail, not be wrong."""
    h, w, b, targets = _problem(3)
    loss = chunked_cross_entropy_sum(_deferred(h, w, b, 0), targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward twice"):
        loss.backward()


def test_auto_chunking_rule():
    assert chunk_tokens(0, 10**6, 10**6) is None and chunk_tokens(96, 8, 8) == 96
    assert chunk_tokens(-1, 8 * 256, 50257) is None  # GPT-2 at 8 x 256: 411 MB of logits, unchunked
    assert chunk_tokens(-1, AUTO_BYTES // (4 * 128256) + 1, 128256) == 512  # 128k vocabulary: 512 tokens (251 MiB) a chunk


MODELS = {
    "gpt": ["model=gpt-tiny"],
    "gpt-tied": ["model=gpt-tiny", "model.tie_embeddings=true"],
    "llama": ["model=gpt-tiny", "model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"],  # transformers' own model
}


def _head_losses(model: str, chunk: int | None) -> tuple[float, dict[str, torch.Tensor]]:
    """A tiny model's summed loss and gradients through its own head: plain (None), or with the projection deferred to
    the chunked (chunk > 0) or the fused loss (chunk -1, the default: 60 tokens are never chunked)."""
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.init import materialize

    cfg = load_config(None, MODELS[model])
    lm = build_causal_lm(cfg.model, cfg.hf)
    materialize(lm.module, seed=3, device=torch.device("cpu"), init_spec=lm.init_spec)
    lm.after_materialize(torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 256, (3, 20), generator=g)
    targets = torch.randint(0, 256, (3, 20), generator=g)
    targets[:, :6] = -100
    head = lm.chunked_head(chunk) if chunk is not None else None
    with head.deferred() if head is not None else torch.enable_grad():
        out = lm.logits(ids)
        assert (out.shape[-1] == 32) == (chunk is not None)  # deferred: the final norm's output, not [.., vocab] logits
        loss = summed_token_loss(out, targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in lm.module.named_parameters()}


@pytest.mark.parametrize("chunk", [13, -1])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_head_deferred_equals_plain(model, chunk):
    ref_loss, ref = _head_losses(model, None)
    loss, got = _head_losses(model, chunk)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert ref.keys() == got.keys() and ("lm_head.weight" in ref) == (model != "gpt-tied")
    for name in ref:
        _assert_close(got[name], ref[name], name)


def _vocab_parallel(chunk: int) -> str:
    """Each tp rank holds its padded shard of the vocabulary rows (and bias); losses and gradients equal the plain ones."""
    import torch.distributed as dist

    from behemoth.parallel.tensor.comm import TPComm
    from behemoth.parallel.tensor.layers import ShardLayout, VocabShard

    tp = TPComm.of(dist.group.WORLD)
    h, w, b, targets = _problem(2)
    ref = F.cross_entropy(F.linear(h, w, b), targets, reduction="sum", ignore_index=-100)
    ref.backward()
    expected = _grads(h, w, b)
    layout = ShardLayout.padded((V, D), 0, tp)
    vocab = VocabShard.of(layout)
    w_local = layout.take_local(w.detach()).requires_grad_()
    b_local = ShardLayout((V,), 0, layout.local_size, layout.pieces).take_local(b.detach()).requires_grad_()
    with torch.no_grad():
        w_local[vocab.real :] = 5.0  # padding rows must not count
        b_local[vocab.real :] = 5.0

    def reduce(t: torch.Tensor, op: str) -> None:
        tp.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    loss = chunked_cross_entropy_sum(_deferred(h, w_local, b_local, chunk), targets, VocabSplit(vocab.start, vocab.real, reduce))
    loss.backward()
    _assert_close(loss, ref.detach(), "vocab-parallel loss")
    grad_h = h.grad.clone()
    tp.all_reduce(grad_h)  # each rank's vocabulary rows give a part of dL/dh (the tp region's entry sums them)
    _assert_close(grad_h, expected[0], "vocab-parallel hidden gradient")
    _assert_close(w_local.grad[: vocab.real], layout.take_local(expected[1])[: vocab.real], "vocab-parallel weight gradient")
    _assert_close(b_local.grad[: vocab.real], expected[2][vocab.start : vocab.start + vocab.real], "vocab-parallel bias gradient")
    assert not w_local.grad[vocab.real :].any() and not b_local.grad[vocab.real :].any()
    return "ok"


def _vocab_parallel_then_train(cfg_dict: dict) -> tuple[list[str], dict]:
    """The vocabulary-parallel checks, then training, in one pair of ranks (one process start for both)."""
    return [_vocab_parallel(chunk) for chunk in (6, 1000, 0)], train_body(cfg_dict)


SHORT = ("train.steps=3", "train.eval_every=3", "train.log_every=1", "model.tie_embeddings=true")


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    return run_ranks(1, train_body, tiny_config(tmp_path_factory.mktemp("plain"), *SHORT, "train.loss_chunk=0"))[0]


def _assert_same_run(ref: dict, got: dict) -> None:
    assert_close_runs(ref, got)
    assert got["val"] and abs(got["val"][-1][1] - ref["val"][-1][1]) <= 1e-5 * ref["val"][-1][1]  # evaluation chunks too


def test_vocab_parallel_and_engine_tp2_sequence_parallel_chunks_equal_single_process(plain_run, tmp_path):
    """Vocabulary-parallel chunks equal the plain loss; training at tp=2 + SP with them equals the unchunked single process."""
    cfg = tiny_config(tmp_path, *SHORT, "train.loss_chunk=100", "parallel.tp=2", "parallel.sequence_parallel=true")  # 256 tokens: 3 chunks
    results = run_ranks(2, _vocab_parallel_then_train, cfg)
    assert [checks for checks, _ in results] == [["ok", "ok", "ok"]] * 2
    _assert_same_run(plain_run, results[0][1])


@pytest.mark.slow
def test_engine_training_with_chunks_equals_unchunked(plain_run, tmp_path):
    got = run_ranks(1, train_body, tiny_config(tmp_path, *SHORT, "train.loss_chunk=48"))[0]  # 256 tokens a micro-batch: 6 chunks
    _assert_same_run(plain_run, got)


def _peak_bytes(chunk: int | None) -> int:
    """Peak bytes allocated by the head's linear + loss + backward for 512 tokens over a 4096-word vocabulary: plain
    (None), fused (0) or chunked."""
    from behemoth.profiler.measure import LiveBytes

    g = torch.Generator().manual_seed(5)
    h = torch.randn(512, 64, generator=g).requires_grad_()
    w = (torch.randn(4096, 64, generator=g) * 0.1).requires_grad_()
    targets = torch.randint(0, 4096, (512,), generator=g)
    with LiveBytes() as live:
        if chunk is not None:
            loss = chunked_cross_entropy_sum(_deferred(h, w, None, chunk), targets)
        else:
            loss = F.cross_entropy(F.linear(h, w).float(), targets, reduction="sum")
        loss.backward()
    return live.peak


def test_peak_memory_falls_with_the_chunk(library):
    logits = 512 * 4096 * 4  # 8 MiB of float32 logits; the gradients of h and W are 1.1 MiB together
    plain, fused, big, small = _peak_bytes(None), _peak_bytes(0), _peak_bytes(256), _peak_bytes(32)
    assert plain >= 2 * logits, plain  # the logits and their gradient (softmax) at once
    # one logits buffer, kept and reused in place, and the gradients of h and W once each (by oneDNN too: its weight
    # gradient, summed [d, vocab], is returned as a view, not copied while the logits live)
    assert fused <= logits + (512 + 4096) * 64 * 4 + 64 * 1024, fused
    assert plain > fused > big > small, (plain, fused, big, small)
    assert small <= 4 * 32 * 4096 * 4 + 2 * (512 + 4096) * 64 * 4, small  # a few chunks' logits plus the gradients


LAYOUTS = {
    "zero3": ("parallel.zero_stage=3", "train.micro_batch=2"),
    "pp2_zb": ("parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batch=2"),
    "offload": ("offload.params=disk", "offload.optimizer=disk", "train.micro_batch=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [24, -1])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_chunked_loss_under_other_layouts(plain_run, tmp_path, layout, chunk):
    """ZeRO-3's gathered head, a zero-bubble pipeline's split backward, offload's streamed head: chunked (24: 64 tokens a
    micro-batch in 3 chunks) and fused (-1) each equal the plain run
    (`OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_chunked_loss.py`)."""
    cfg = tiny_config(tmp_path, *SHORT, f"train.loss_chunk={chunk}", *LAYOUTS[layout])
    _assert_same_run(plain_run, run_ranks(2, train_body, cfg)[0])
