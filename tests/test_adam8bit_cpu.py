"""The CPU 8-bit AdamW (`blockwise8.BlockwiseAdam8`) against bitsandbytes' own update in the same stored format:
the same codes and scales from the same state (up to the rounding of values on a quantization bin's edge), the same
parameters within float32 rounding, and a state written by either path stepped by the other."""

from __future__ import annotations

import pytest
import torch

from behemoth.errors import BehemothError
from behemoth.parallel.sync import AdamWSettings
from behemoth.parallel.zero import blockwise8
from behemoth.parallel.zero.adam import BLOCK, Adam8bit, ShardPiece

bnb_f = pytest.importorskip("bitsandbytes.functional")

CPU = torch.device("cpu")
SETTINGS = AdamWSettings(1e-3, (0.9, 0.95), 0.1)
# a matrix with a partial last block, a norm shorter than a block, a matrix over several spans when SPAN is small
PIECES = [ShardPiece(0, 5 * BLOCK + 37, True), ShardPiece(5 * BLOCK + 37, 100, False), ShardPiece(5 * BLOCK + 137, 40 * BLOCK, True)]
N = 45 * BLOCK + 137
SAME_CODES = 0.999  # fraction of codes the two paths must write alike from the same state


def grads(steps: int, seed: int = 0) -> list[torch.Tensor]:
    """Gradients over six decades of scale, with one block of zeros (a row no token reached)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        g = torch.randn(N, generator=gen) * torch.logspace(-5, 1, N)
        g[2 * BLOCK : 3 * BLOCK] = 0.0
        out.append(g)
    return out


def fresh_state(adam: Adam8bit) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(n, dtype=d) for k, (n, d) in adam.state_spec(PIECES, N).items()}


def run(adam: Adam8bit, p: torch.Tensor, state: dict[str, torch.Tensor], gs: list[torch.Tensor], first: int = 1) -> None:
    for i, g in enumerate(gs):
        adam.step(p, g.clone(), state, PIECES, lr=1e-3, coef=0.7, step=first + i)


def code_agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return min(float((a[k] == b[k]).double().mean()) for k in ("m", "v"))


def test_the_kernel_is_chosen_by_device():
    assert Adam8bit(SETTINGS, CPU).kernel == "torch" and Adam8bit(SETTINGS, CPU, kernel="bitsandbytes").cpu is None
    with pytest.raises(BehemothError, match="kernel='bitsandbytes'"):
        Adam8bit(SETTINGS, torch.device("meta"), kernel="torch")


def test_quantization_writes_bitsandbytes_codes_and_scales():
    """Blockwise quantization of values over ten decades (and a block of zeros) gives bitsandbytes' CPU scales exactly
    and its codes but for values on a bin's edge (one rounding apart: < 0.05% of them, one code away); dequantization
    is bitsandbytes' exactly."""
    x = torch.randn(300 * BLOCK + 77, generator=torch.Generator().manual_seed(1)) * torch.logspace(-8, 2, 300 * BLOCK + 77)
    x[5 * BLOCK : 6 * BLOCK] = 0.0
    for signed, values in ((True, x), (False, x.square())):
        code = bnb_f.create_dynamic_map(signed=signed)
        ref, qs = bnb_f.quantize_blockwise(values, code=code, blocksize=BLOCK)
        mine = blockwise8.BlockwiseMap(code)
        codes, absmax = torch.empty_like(ref), torch.empty_like(qs.absmax)
        mine.quantize(values, codes, absmax, torch.empty(values.numel()), torch.empty(values.numel(), dtype=torch.int32))
        assert torch.equal(absmax, qs.absmax)
        assert float((codes == ref).double().mean()) >= 0.9995 and int((codes.int() - ref.int()).abs().max()) <= 1
        assert torch.equal(codes[5 * BLOCK : 6 * BLOCK], ref[5 * BLOCK : 6 * BLOCK]), "a block of zeros: codes 0, as bitsandbytes"
        back = torch.empty(values.numel())
        mine.dequantize(ref, qs.absmax, back, torch.empty(values.numel(), dtype=torch.int32))
        assert torch.equal(back, bnb_f.dequantize_blockwise(ref, absmax=qs.absmax, code=code, blocksize=BLOCK))


def test_one_step_from_the_same_state_equals_bitsandbytes_update():
    """From a state bitsandbytes wrote (3 steps), one step of each: the codes agree on >= 99.9% of elements and differ
    by one code elsewhere, the scales and the parameters agree to float32 rounding."""
    ours, ref = Adam8bit(SETTINGS, CPU), Adam8bit(SETTINGS, CPU, kernel="bitsandbytes")
    p, state = torch.randn(N, generator=torch.Generator().manual_seed(2)), fresh_state(ref)
    gs = grads(4)
    run(ref, p, state, gs[:3])
    p1, s1, p2, s2 = p.clone(), {k: v.clone() for k, v in state.items()}, p.clone(), {k: v.clone() for k, v in state.items()}
    run(ours, p1, s1, gs[3:], first=4)
    run(ref, p2, s2, gs[3:], first=4)
    assert code_agreement(s1, s2) >= SAME_CODES
    for k in ("m", "v"):
        assert int((s1[k].int() - s2[k].int()).abs().max()) <= 1
    for k in ("m_absmax", "v_absmax"):
        assert torch.allclose(s1[k], s2[k], rtol=1e-6, atol=0)
    assert float((p1 - p2).abs().max()) <= 1e-6 and float((p1 - p).abs().max()) > 1e-4, "the step moved the weights"


def steps_with_a_resume(first: Adam8bit, second: Adam8bit, p: torch.Tensor, gs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Half the steps on `first`, a checkpoint round trip of the moments (float32, as checkpoints hold them), the rest
    on `second`; returns the state."""
    state = fresh_state(first)
    run(first, p, state, gs[: len(gs) // 2])
    resumed = fresh_state(second)
    second.load_moments(resumed, *first.moments(state, PIECES), PIECES)
    assert code_agreement(resumed, state) >= SAME_CODES, "dequantize then quantize gives the codes back"
    run(second, p, resumed, gs[len(gs) // 2 :], first=len(gs) // 2 + 1)
    return resumed


@pytest.mark.parametrize("switch", ["torch then bitsandbytes", "bitsandbytes then torch"])
def test_a_state_written_by_one_path_steps_on_the_other(switch):
    """4 steps on one path, a checkpoint round trip, 4 on the other, against the same on bitsandbytes alone: codes
    alike on >= 99.9% of elements, parameters within 2% of the whole update."""
    ours, ref = Adam8bit(SETTINGS, CPU), Adam8bit(SETTINGS, CPU, kernel="bitsandbytes")
    p0, gs = torch.randn(N, generator=torch.Generator().manual_seed(3)), grads(8, seed=1)
    p_ref, p = p0.clone(), p0.clone()
    s_ref = steps_with_a_resume(ref, ref, p_ref, gs)
    state = steps_with_a_resume(*((ours, ref) if switch.startswith("torch") else (ref, ours)), p, gs)
    assert code_agreement(state, s_ref) >= SAME_CODES
    assert float((p - p_ref).abs().max()) <= 0.02 * float((p_ref - p0).abs().max())


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_spans_and_threads_change_no_value(monkeypatch, threads):
    """Stepping in spans of one block, or of three, on one thread or on four, gives exactly the same step."""
    results = []
    for span, count in ((blockwise8.SPAN, 1), (BLOCK, 1), (3 * BLOCK, 1), (3 * BLOCK, 4)):
        monkeypatch.setattr(blockwise8, "SPAN", span)
        threads(count)
        adam = Adam8bit(SETTINGS, CPU)
        p, state = torch.randn(N, generator=torch.Generator().manual_seed(4)), fresh_state(adam)
        run(adam, p, state, grads(2))
        results.append((p, state))
    for p, state in results[1:]:
        assert torch.equal(p, results[0][0]) and all(torch.equal(state[k], results[0][1][k]) for k in state)


def test_kernels_in_a_stepping_thread_are_serial_and_the_setting_comes_back(threads):
    threads(2)
    seen = []
    with blockwise8.serial_kernels():
        seen.append(torch.get_num_threads())
    assert seen == [1 if blockwise8.openmp() is not None else 2] and torch.get_num_threads() == 2
