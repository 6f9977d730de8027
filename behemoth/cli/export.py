"""`behemoth export` for a LoRA run: its adapters in PEFT's layout, or (`--merge`) merged into the base folder's weights."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from behemoth.errors import BehemothError


def is_lora_run(saved: dict[str, Any]) -> bool:
    return bool(saved.get("finetune", {}).get("lora", {}).get("enabled"))


def export_lora(args: argparse.Namespace, ckpt: Path, saved: dict[str, Any]) -> int:
    """The checkpoint's adapters as a PEFT folder (default RUN/adapter), or with --merge an HF folder of merged weights."""
    from behemoth.config import Config
    from behemoth.inference.adapters import export_merged, save_run_adapter

    if args.hf:
        raise BehemothError("export --hf of a LoRA run: its checkpoints hold only the adapters", "use behemoth export RUN --merge --out DIR")
    cfg = Config.model_validate(saved)
    run_dir = ckpt.parent.parent
    if args.merge:
        out = export_merged(ckpt, cfg, Path(args.out) if args.out else run_dir / "merged")
        print(f"behemoth: wrote {out} (base {cfg.hf.weights} + LoRA adapters merged, an HF folder) from {ckpt}")
    else:
        out = save_run_adapter(ckpt, cfg, Path(args.out) if args.out else run_dir / "adapter")
        print(f"behemoth: wrote {out} (LoRA adapters, PEFT layout) from {ckpt}")
    return 0


def export_tokenizer(saved: dict[str, Any], run_dir: Path, folder: Path) -> str:
    """The tokenizer the run trained with (the run directory's copy, else the folder that encoded its corpus) written
    into the exported folder, so that it loads and chats on its own; what the export line says of it."""
    from behemoth.config import Config
    from behemoth.data import copy_tokenizer
    from behemoth.inference.loading import tokenizer_home

    home = tokenizer_home(Config.model_validate(saved), run_dir)
    copied = copy_tokenizer(home, folder)
    return f", with the tokenizer from {home}" if copied else ", no tokenizer: the run trained on bytes"


def refuse_merge(args: argparse.Namespace) -> None:
    if getattr(args, "merge", False):
        raise BehemothError(f"export --merge: {args.path} is not a LoRA run (finetune.lora.enabled=false): nothing to merge", "drop --merge")
