"""Offloaded inference equals in-memory inference (host and disk, from a DCP checkpoint, an HF folder or a seed) while
holding at most prefetch + 1 blocks; int8 weight-only generation stays within its stated tolerance of float32."""

from __future__ import annotations

import pytest

from behemoth.inference import CachePolicy, SamplingParams, load
from tests.dist import run_ranks
from tests.test_generate import prompts, runtime, save_hf  # noqa: F401 (the runtime fixture)

pytest.importorskip("transformers")

PARAMS = [SamplingParams(max_tokens=9), SamplingParams(max_tokens=6, temperature=0.8, seed=4), SamplingParams(max_tokens=9)]


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    """behemoth's GPT (4 blocks) after 6 steps on one process, checkpointed: a DCP source."""
    from tests.common import tiny_config, train_body

    run = tmp_path_factory.mktemp("run")
    run_ranks(1, train_body, tiny_config(run, "model.n_layer=4", "train.steps=6", "checkpoint.every=6"))
    return run


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    save_hf("llama", folder)
    return folder


def sources(checkpoint_run, llama_folder):
    from behemoth.config import load_config
    from behemoth.inference.loading import Source, resolve_source

    return {
        "checkpoint": resolve_source(str(checkpoint_run)),
        "hf": resolve_source(llama_folder),
        "seed": Source(load_config(None, ["model=gpt-tiny", "model.n_layer=3", "model.context=64"]), None, None),
    }


@pytest.mark.parametrize("kind", ["checkpoint", "hf", "seed"])
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_offloaded_generation_equals_in_memory(runtime, checkpoint_run, llama_folder, tmp_path, kind, tier):  # noqa: F811
    from behemoth.inference.generate import offloaded_generator
    from behemoth.inference.offload import generation_policy

    source = sources(checkpoint_run, llama_folder)[kind]
    batch = prompts(source.config.model.vocab_size, lengths=(3, 8, 5))
    expected = [c.tokens for c in load(source).generate(batch, PARAMS)]
    off = offloaded_generator(source, generation_policy(tier, str(tmp_path / "blocks"), prefetch=1), CachePolicy(), rt=runtime)
    try:
        assert [c.tokens for c in off.generator.generate(batch, PARAMS)] == expected
        per_block = off.streamed_bytes / source.config.model.n_layer
        stats = off.stats
        assert stats.peak_held <= 2 * per_block + 1 and stats.fetched_bytes >= off.streamed_bytes  # prefetch + 1 blocks at most
        if tier == "disk":
            assert len(list((tmp_path / "blocks").rglob("*.bin"))) == source.config.model.n_layer
    finally:
        off.close()


def test_int8_weights_stay_within_tolerance(runtime, checkpoint_run):  # noqa: F811
    """Stated tolerance: every logit within 3% of the float32 logits' largest magnitude, the validation loss within 1%,
    and the linear weights take about a quarter of their float32 bytes (scales included)."""
    from behemoth.inference.generate import reference_logits
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.quantize import quantize_int8, validation_loss

    source = resolve_source(str(checkpoint_run))
    plain, quant = load_model(source, runtime), load_model(source, runtime)
    stats = quantize_int8(quant.module, transposed=quant.lm.transposed)
    assert stats.layers == 4 * 4 + 1 and stats.int8_bytes < 0.3 * stats.float_bytes
    tokens = prompts(lengths=(20,))[0]
    ref, got = reference_logits(plain, tokens), reference_logits(quant, tokens)
    assert 0 < float((got - ref).abs().max()) <= 0.03 * float(ref.abs().max())
    before, after = validation_loss(plain, source.config), validation_loss(quant, source.config)
    assert abs(after - before) <= 0.01 * before, (before, after)
    greedy = SamplingParams(max_tokens=12)
    same = sum(
        a == b for a, b in zip(load(source).generate([tokens], greedy)[0].tokens, load(source, quantize="int8").generate([tokens], greedy)[0].tokens)
    )
    assert same >= 6, same


def test_int8_with_tensor_parallelism_equals_int8_single_process(llama_folder):
    from tests.test_generate import _generate_quantized

    batch = prompts(lengths=(4, 7))
    single = run_ranks(1, _generate_quantized, llama_folder, batch, 1)[0]
    assert run_ranks(2, _generate_quantized, llama_folder, batch, 2)[0] == single
