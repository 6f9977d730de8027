"""The random-weight Llamas the benchmarks share: their shapes, a save_pretrained folder of one, seeded prompts."""

from __future__ import annotations

SHAPES = {  # llama shapes (model section + hf section overrides)
    "quick": dict(n_layer=4, d_model=256, n_head=8, kv_heads=4, ffn=688, vocab_size=2048, context=512),
    "full": dict(n_layer=8, d_model=512, n_head=8, kv_heads=4, ffn=1376, vocab_size=32000, context=1024),
}


def llama_options(shape: dict[str, int]) -> list[str]:
    s = dict(shape)
    return ["model=hf:llama", f"hf.kv_heads={s.pop('kv_heads')}", f"hf.ffn={s.pop('ffn')}", *[f"model.{k}={v}" for k, v in s.items()]]


def save_llama(shape: dict[str, int], folder: str) -> int:
    """A random-weight Llama of `shape` saved with save_pretrained; its parameter count."""
    import torch
    import transformers

    from behemoth.config import load_config
    from behemoth.models.hf import transformers_config

    cfg = load_config(None, llama_options(shape))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers_config(cfg.model, cfg.hf))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1)  # wide enough that greedy decoding does not repeat one token
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def make_prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()
