"""QLoRA-style LoRA (finetune.lora.base_bits=8): the frozen base's block linears held in int8 with a scale per output
channel under float32 adapters. It trains, equals a plain peft loop on a base whose weights are those dequantized
values, and the base holds about a quarter of its float32 bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.test_lora import assert_same_training, behemoth_lora, folder, lora_config, peft_loop  # noqa: F401  (folder: a fixture)

pytest.importorskip("peft")


def dequantized_base(model: Any) -> None:
    """Every base weight of peft's adapted layers replaced by its int8 round trip: per output row, scale = max |w| / 127,
    w -> round(w / scale) * scale (written here independently of behemoth's code)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("base_layer") and ".layers." in name:
                w = module.weight
                scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
                w.copy_(torch.round(w / scale).clamp(-127, 127) * scale)


def base_bytes(cfg_dict: dict[str, Any]) -> dict[str, int]:
    """Bytes of the block linears' stored weights (parameters and buffers, scales included) in behemoth's model, the
    elements of those weights, and how many are int8."""
    from behemoth.config import Config
    from behemoth.engine import build_model
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    model = build_model(cfg, init_runtime(timeout_s=cfg.run.timeout_s))
    blocks = model.module.get_submodule(model.lm.layers.blocks)
    held = [t for n, t in [*blocks.named_parameters(), *blocks.named_buffers()] if ".lora_" not in n and t.dim() == 2]
    weights = [t for t in held if t.shape[1] > 1]
    return {
        "bytes": sum(t.untyped_storage().nbytes() for t in held),
        "elements": sum(t.numel() for t in weights),
        "int8": sum(t.dtype == torch.int8 for t in held),
    }


@pytest.mark.slow
def test_int8_base_trains_and_equals_the_dequantized_reference(folder, tmp_path):  # noqa: F811
    """Loss falls over the steps and equals peft on the dequantized base (loss per step, adapters); peft on the float
    base differs (the quantization is really there); the int8 block weights and scales take < 0.3x float32's bytes."""
    cfg = lora_config(tmp_path, folder, "finetune.lora.base_bits=8")
    reference = peft_loop(folder, cfg, prepare=dequantized_base)
    got = run_ranks(1, behemoth_lora, cfg, reference["init"])[0]
    assert got["losses"][-1] < got["losses"][0]
    assert_same_training(reference, got)
    plain = peft_loop(folder, cfg)
    assert max(abs(a - b) / a for a, b in zip(plain["losses"], reference["losses"])) > 1e-5
    sizes = run_ranks(1, base_bytes, cfg)[0]
    assert sizes["int8"] == 14, sizes  # 7 linears in each of 2 blocks
    assert sizes["bytes"] < 0.3 * 4 * sizes["elements"], sizes
