"""Small serving breakages fixed: ids outside a byte vocabulary render losslessly (and encode back); int8 under tensor
parallelism leaves GPT-2's tied head in float (200 of 200 greedy tokens equal the single-process int8 model's); a family
with no cached decoding is refused before its weights load."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

GPT2 = ["model=gpt-tiny", "model=hf:gpt2", "model.n_layer=2", "model.tie_embeddings=true", "model.vocab_size=257", "model.context=256"]


def test_ids_beyond_bytes_render_losslessly_without_a_tokenizer():
    from behemoth.inference.text import tokenizer_for

    tok = tokenizer_for(512)
    ids = [104, 105, 300, 256, 511, 0xC3, 0xA9, 33]
    text = tok.decode(ids)
    assert text == "hi<|token_id:300|><|token_id:256|><|token_id:511|>\u00e9!"  # not chr(300 % 256)
    assert tok.encode(text) == ids
    assert tokenizer_for(256).decode([104, 105]) == "hi"
    assert tokenizer_for(200) is None


def _quantized_tokens(folder: str, tp: int, prompt: list[int]) -> tuple[list[str], list[int]] | None:
    """This rank's quantized layer names, and (rank 0) 200 greedy tokens of the int8 model at this tp."""
    from behemoth.inference.generate import CachePolicy, follow_model, generator_for, load_for_generation
    from behemoth.inference.loading import resolve_source
    from behemoth.inference.quantize import QUANTIZED
    from behemoth.inference.sampling import SamplingParams
    from behemoth.topology import init_runtime

    source = resolve_source(folder)
    rt = init_runtime(tp=tp)
    model = load_for_generation(source, rt, tp=tp, quantize="int8")
    names = [n for n, m in model.module.named_modules() if hasattr(m, QUANTIZED)]
    cache = CachePolicy(block_size=16, memory_mb=4)
    if rt.rank != 0:
        follow_model(model, cache)
        return None
    gen = generator_for(model, source, cache)
    try:
        return names, gen.generate([prompt], SamplingParams(max_tokens=200), ignore_eos=True)[0].tokens
    finally:
        gen.close()


@pytest.mark.slow  # two processes, 200 tokens: ~100 s on 2 loaded cores (pytest -m slow tests/test_serve_fixes.py)
def test_int8_under_tensor_parallelism_keeps_gpt2s_tied_head_in_float(tmp_path):
    import transformers

    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, GPT2)
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "ln" in name and name.endswith("weight") else 0.0, 0.3)
    hf.save_pretrained(str(tmp_path))
    prompt = [5, 17, 200, 3, 99]
    names, single = run_ranks(1, _quantized_tokens, str(tmp_path), 1, prompt)[0]
    sharded = run_ranks(2, _quantized_tokens, str(tmp_path), 2, prompt)[0]
    assert sharded[0] == names and len(names) == 2 * 4  # attention in/out and the MLP's two layers of each block; no head
    assert sum(a == b for a, b in zip(sharded[1], single)) == len(single) == 200


def test_mixtral_greedy_equals_transformers_generate(tmp_path):
    """The MoE family generates with cached decoding: its greedy tokens are transformers' own."""
    import torch.distributed as dist
    import transformers

    from behemoth.inference import CachePolicy, SamplingParams, load
    from tests.test_generate_offload import save_mixtral

    save_mixtral(str(tmp_path))
    prompts = [[3, 9, 27, 81, 5], [100, 2]]
    hf = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).eval()
    expected = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, len(p) :].tolist() for p in prompts]
    try:
        got = [
            c.tokens
            for c in load(str(tmp_path), cache=CachePolicy(block_size=4, memory_mb=2)).generate(
                prompts, SamplingParams(max_tokens=12), ignore_eos=True
            )
        ]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert got == expected
