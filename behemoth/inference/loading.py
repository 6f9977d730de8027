"""Loading a model to generate from: any behemoth checkpoint (saved under any layout) or a Hugging Face folder.

A source is a run directory (its latest checkpoint), a checkpoint folder, or a local `save_pretrained`
folder. Checkpoints keep single-process names and full shapes, so the model is laid out for inference
(`parallelize(..., for_training=False)` with tensor and pipeline degrees: no data parallelism, no gradient syncs or
buffers, no optimizer) whatever layout trained it, and DCP reads each rank's part of every tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from behemoth.config import Config, load_config
from behemoth.data import BatchLayout, has_tokenizer
from behemoth.errors import BehemothError, Refused
from behemoth.faults.checkpoint import load_checkpoint, read_meta, resolve_checkpoint, validate_checkpoint, verify_files
from behemoth.models.causal_lm import build_causal_lm, tied_names
from behemoth.models.init import FULL_NAME, InitSpec
from behemoth.parallelize import ParallelModel, parallelize
from behemoth.plan import ParallelPlan
from behemoth.planner.feasibility import problems
from behemoth.topology import Runtime

ZEROS = InitSpec("zeros")


@dataclass(frozen=True)
class Source:
    """Where a model's weights come from: its config, and the checkpoint folder (None: the HF folder of hf.weights)."""

    config: Config
    checkpoint: Path | None
    folder: str | None  # where tokenizer files may be: the HF folder or the run directory

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-sequence ids of an HF folder's config.json (generation stops there unless told otherwise)."""
        if not self.config.hf.weights:
            return []
        from behemoth.models.hf import read_weights_config

        eos = read_weights_config(self.config.hf.weights).get("eos_token_id")
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def resolve_source(path: str | Path, overrides: list[str] = ()) -> Source:
    """The config and weights of a run directory, checkpoint folder or Hugging Face folder (`key=value` overrides)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise BehemothError(f"{path} does not exist", "pass a run directory, a checkpoint folder or a save_pretrained folder")
    if (p / "config.json").is_file() and not (p / "meta.json").exists() and not (p / "checkpoints").is_dir():
        return Source(load_config(None, [f"hf.weights={p}", *overrides]), None, str(p))
    ckpt = resolve_checkpoint(
        p, use="use {} instead", missing="pass a run directory that has saved a checkpoint, a checkpoint folder or a save_pretrained folder"
    )
    verify_files(ckpt)
    saved = read_meta(ckpt).get("config")
    if not isinstance(saved, dict):
        raise BehemothError(f"checkpoint {ckpt} has no config in its meta.json", "generate from a checkpoint behemoth wrote")
    cfg = Config.model_validate(saved)
    if overrides:
        cfg = load_config(None, [*_flatten(saved), *overrides])
        validate_checkpoint(ckpt, cfg.model.model_dump(mode="json"))  # an option may not change the model's shape
    return Source(cfg, ckpt, tokenizer_home(cfg, ckpt.parent.parent))


def tokenizer_home(cfg: Config, run_dir: Path) -> str:
    """Where a checkpoint's tokenizer is: its run directory when training copied the files there, else the folder that
    encoded its corpus (data.tokenizer or hf.weights, if it still holds them); else the run directory (bytes)."""
    if has_tokenizer(str(run_dir)):
        return str(run_dir)
    try:
        return cfg.tokenizer_folder or str(run_dir)
    except BehemothError:  # that folder is gone or changed: the run directory's own (byte) decoding
        return str(run_dir)


def _flatten(saved: dict, prefix: str = "") -> list[str]:
    """A saved config as key=value overrides (values in YAML's flow syntax)."""
    import yaml

    out = []
    for key, value in saved.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        elif value is not None:
            out.append(f"{prefix}{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")
    return out


def inference_config(cfg: Config, *, tp: int = 1, pp: int = 1, ep: int = 1, tp_mode: str = "1d") -> Config:
    """The config laid out for generation: tp x pp x ep processes, no data parallelism, no ZeRO, one micro-batch per
    stage; with ep > 1 every rank holds 1/ep of each MoE layer's experts and runs the same requests, the rest of the
    model replicated. tp_mode=2d: the tp ranks as a q x q grid whose rows each run the whole batch (a nominal batch of q
    meets training's rule that the rows split it)."""
    plan = ParallelPlan(
        tp=tp,
        tp_mode=tp_mode,
        pp=pp,
        ep=ep,
        dp=1,
        schedule="gpipe",
        balance="flops" if pp > 1 else cfg.parallel.balance,
    )
    rows = math.isqrt(tp) if tp_mode == "2d" else 1
    return cfg.replace(parallel=plan, train={"global_batch": pp * ep * rows, "micro_batch": rows, "seq_len": None})


def grid_generation_problems(tp_mode: str, *, pp: int, ep: int, quantize: str | None, offload: bool, adapter: bool) -> list[str]:
    """Why generation on a 2-D grid (--tp-mode 2d) cannot run with these options (empty: it can): it runs the grid's
    layers in memory, in float32 or bf16, one grid for every layer."""
    if tp_mode == "1d":
        return []
    if tp_mode != "2d":
        return [f"--tp-mode {tp_mode}: generation runs 1d or 2d (a 2.5-D or 3-D checkpoint loads under either)"]
    others = {"--pp": pp > 1, "--ep": ep > 1, "--quantize": quantize is not None, "--offload": offload, "--adapter": adapter}
    return [f"--tp-mode 2d with {name}: not composed yet (use --tp-mode 1d)" for name, bad in others.items() if bad]


def check_inference_plan(cfg: Config, world: int) -> None:
    """Refuse, before any worker starts, degrees this model cannot be split by (heads, widths, blocks)."""
    found = problems(cfg, world)
    if found:
        raise Refused(found)


def load_model(
    source: Source,
    rt: Runtime,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    quantize: str | None = None,
    expert_layout: str = "owned",
    tp_mode: str = "1d",
) -> ParallelModel:
    """This rank's part of the model, laid out for generation and holding the source's weights (`quantize="int8"`: its
    linear weights in int8, per-channel scales; "int4": 4-bit, a scale per 64 input channels; `ep`: this rank's experts
    only, read as their slices of the checkpoint's tensors, computed in `expert_layout`: owned, alltoall or gather,
    parallel/expert/dispatch.py; `tp_mode` 2d: the tp ranks as a grid, parallel/tensor/twod.py)."""
    cfg = inference_config(source.config, tp=tp, pp=pp, ep=ep, tp_mode=tp_mode)
    lm = build_causal_lm(cfg.model, cfg.hf)
    lora = cfg.finetune.lora if source.checkpoint is not None and cfg.finetune.lora.enabled else None  # a LoRA run's checkpoint: adapters
    if source.checkpoint is not None and lora is None:
        lm.weights = None  # the checkpoint holds the weights (a run started from hf.weights overwrote them)
    if source.checkpoint is not None or lm.weights:
        lm.init_spec = lambda name: ZEROS  # every value is read from the files: drawing them first is time and a transient copy
    if quantize not in (None, "int8", "int4"):
        raise BehemothError(f"quantization {quantize!r} is unknown", "use int8 or int4")
    model = parallelize(
        lm,
        cfg.parallel,
        rt,
        batch=BatchLayout(pp, 1, 1),
        seq_len=cfg.model.context,
        seed=cfg.train.seed,
        timeout_s=cfg.run.timeout_s,
        for_training=False,
        lora=lora,
    )
    if source.checkpoint is not None:
        state = {k: v for k, v in parameter_state(model.module).items() if lora is None or ".lora_" in k}
        load_checkpoint(model.checkpoint_views({"model": state}), source.checkpoint, rt.world_group)
    model.module.eval()
    if model.experts is not None and ep > 1:
        model.experts.set_layout(expert_layout)
    if lora is not None:  # the base came from hf.weights; its adapters are folded into it
        from behemoth.models.lora import merge_adapters

        merge_adapters(model.module)
    if cfg.finetune.adapter:  # a PEFT LoRA folder, merged into this rank's weights before any quantization
        from behemoth.inference.adapters import apply_adapter

        apply_adapter(model.module, cfg.finetune.adapter)
    if quantize == "int8":
        from behemoth.inference.quantize import quantize_int8

        quantize_int8(model.module, transposed=model.lm.transposed)
    if quantize == "int4":  # group-wise, 64 input channels a group (quantize_int4.py)
        from behemoth.inference.quantize_int4 import quantize_int4

        quantize_int4(model.module, transposed=model.lm.transposed)
    return model


def parameter_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (this rank's part) by its single-process name, a tied one under each of its names: what DCP
    reads a checkpoint into, in place (a model laid out for inference has no syncs to ask)."""
    state = {getattr(p, FULL_NAME, n): p.detach() for n, p in module.named_parameters()}
    for name, others in tied_names(module).items():
        if name in state:
            state.update(dict.fromkeys(others, state[name]))
    return state
