"""Generation on a 2-D grid (`behemoth generate --tp 4 --tp-mode 2d`): every weight 1/q^2 per process, each grid row
running the whole batch and the KV cache split by heads over the q columns. Greedy tokens of a Llama folder (4 query
heads over 2 KV heads), a batch of prompts of different lengths, equal transformers' own `generate`; so do they when the
cache is too small for the whole batch at once. Options the grid does not run with are
refused before anything loads."""

from __future__ import annotations

import pytest

from tests.dist import run_ranks
from tests.test_generate import hf_generate, prompts, save_hf

pytest.importorskip("transformers")


SMALL_MB = 12 * 1024 / 2**20  # 12 blocks of 4 tokens per rank (4 layers x k, v x 1 KV head x 8 dims, float32): the batch needs 18


def _generate_on_grid(folder: str, batch: list[list[int]], max_tokens: int) -> list[list[list[int]]] | None:
    """The batch's greedy tokens on the grid with an ample cache, then with SMALL_MB (one runtime for both)."""
    from behemoth.inference.generate import CachePolicy, generate_on_ranks
    from behemoth.topology import init_runtime

    rt, params, out = init_runtime(tp=4), [dict(max_tokens=max_tokens)] * len(batch), []
    for memory_mb in (4.0, SMALL_MB):
        cache = CachePolicy(block_size=4, memory_mb=memory_mb)
        got = generate_on_ranks(folder, [], batch, params, tp=4, pp=1, tp_mode="2d", cache=cache, rt=rt)
        out.append(None if got is None else [c.tokens for c in got])
    return None if out[0] is None else out


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("llama"))
    save_hf("llama", folder)
    return folder


def test_greedy_generation_on_a_2x2_grid_equals_transformers(llama):
    """4 prompts of 5, 11, 2 and 8 tokens, 10 new tokens each, on 4 gloo ranks; then with a cache of 12 blocks of 4 tokens
    per rank, too few for the whole batch at once (requests wait, or are preempted and recomputed): the same tokens as
    transformers."""
    batch = prompts()
    want = hf_generate(llama, batch, max_new_tokens=10)
    assert len({t for row in want for t in row}) > 6, want  # the comparison is not between constant sequences
    got = run_ranks(4, _generate_on_grid, llama, batch, 10, timeout=300)
    assert got[0] == [want, want] and all(r is None for r in got[1:])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "2"], "--tp-mode 2d needs --tp to be a square q*q >= 4 (got 2)"),
        (["--tp", "4", "--pp", "2", "--nproc", "8"], "--tp-mode 2d with --pp: not composed yet"),
        (["--tp", "4", "--quantize", "int8"], "--tp-mode 2d with --quantize: not composed yet"),
        (["--tp", "16", "--nproc", "16"], "--tp 16 (a 4 x 4 grid) does not split hf.kv_heads=2 (by 4)"),
    ],
)
def test_grid_generation_refused_before_loading(llama, capsys, argv, message):
    from behemoth.cli import main

    assert main(["generate", llama, "--prompt-ids", "1,2", "--tp-mode", "2d", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:"), err
