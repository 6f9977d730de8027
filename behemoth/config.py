"""Typed, validated configuration: one section per component, YAML in and out, key=value overrides."""

from __future__ import annotations

import difflib
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from behemoth.data import BatchLayout, Corpus, SourceSpec, Split, has_tokenizer, prepare_corpus
from behemoth.errors import BehemothError
from behemoth.models.gpt import GPTConfig
from behemoth.models.hf import HFConfig, moe_objective_of, shape_from_weights
from behemoth.plan import ParallelPlan
from behemoth.topology import ParallelDims


class Section(BaseModel):
    """A config section: a validated value (change one with `Config.replace`, which validates the whole config again)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class DataSource(Section):
    """One source of a mixture."""

    path: str = Field(description="text/JSONL/Parquet file, folder, glob, datasets folder (save_to_disk) or .npy/.bin tokens")
    weight: float = Field(1.0, gt=0, description="share of the sequences drawn from this source (relative to the others)")
    field: str | None = Field(None, description="JSONL/Parquet text field (default data.field)")


class DataConfig(Section):
    path: str | None = Field(
        None, description="text/JSONL/Parquet file, folder, glob, datasets folder, .npy or uint16 .bin tokens (default: Python stdlib sources)"
    )
    sources: list[DataSource] | None = Field(None, description="a mixture instead of data.path: [{path: P, weight: W, field: F}, ...]")
    field: str = Field("text", description="the text field of JSONL/Parquet/datasets records (records with messages or prompt/response are chats)")
    tokenizer: str | None = Field(
        None, description="folder whose tokenizer encodes the corpus (default: hf.weights' if it has one, else bytes; 'bytes')"
    )
    loss_on: Literal["assistant", "all"] = Field("assistant", description="chat records: train on assistant tokens only, or on every token")
    packing: Literal["auto", "window", "document"] = Field(
        "auto", description="where sequences start: anywhere (window) or at a document's start (document); auto: document for chats"
    )
    workers: int | None = Field(None, ge=1, description="tokenizer processes (default: all cores for corpora over 8 MB)")
    val_fraction: float = Field(0.05, gt=0, lt=0.5, description="share of each source held out for validation")
    cache_dir: str | None = Field(None, description="where tokenized corpora are cached (default ~/.cache/behemoth)")

    @model_validator(mode="after")
    def _one_kind_of_source(self) -> DataConfig:
        if self.path is not None and self.sources:
            raise ValueError("data.path and data.sources are both set; give one (a single source is data.path)")
        return self


class TrainConfig(Section):
    steps: int = Field(600, ge=1, description="optimizer steps")
    global_batch: int = Field(32, ge=1, description="sequences per optimizer step, over all processes")
    micro_batch: int | None = Field(None, ge=1, description="sequences per process per forward (default: no accumulation)")
    seq_len: int | None = Field(None, ge=2, description="tokens per sequence (default: model context)")
    lr: float = Field(2e-3, gt=0, description="peak learning rate")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR as a fraction of the peak")
    warmup_steps: int = Field(20, ge=0, description="linear warmup steps")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="global gradient-norm clip (0 disables)")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="bf16 = bf16 autocast (for GPUs)")
    seed: int = Field(1234, description="seeds initialization, data order and dropout")
    eval_every: int = Field(50, ge=0, description="validate every N steps (0: only at the end)")
    eval_batches: int = Field(4, ge=1, description="validation batches of global_batch sequences")
    log_every: int = Field(10, ge=1, description="write metrics every N steps")
    peak_tflops: float | None = Field(None, gt=0, description="device peak for MFU (default: measured)")
    nonfinite: Literal["stop", "skip"] = Field("stop", description="a non-finite loss or gradient norm: stop the run, or skip that step's update")
    stop_at: int | None = Field(None, ge=1, description="end this run after step N, validated and checkpointed (the LR schedule spans train.steps)")
    adamw: Literal["auto", "for-loop", "foreach", "fused"] = Field(
        "auto", description="torch's AdamW implementation (auto: fused on CUDA and the CPU, foreach elsewhere; docs/performance.md)"
    )
    compile: bool = Field(
        False,
        description="compile each transformer block with torch.compile (regional; compile time reported apart and cached in "
        "~/.cache/behemoth/inductor; not for MoE models; docs/performance.md)",
    )
    gemm: Literal["auto", "blas", "onednn"] = Field(
        "auto",
        description="library of the CPU float32 linears in training: torch's BLAS (MKL), oneDNN, or auto (oneDNN where a product "
        "timed once per process at its thread count runs faster, compiled blocks included; CUDA and bf16 take F.linear; docs/performance.md)",
    )
    host_memory: Literal["auto", "keep", "return"] = Field(
        "auto",
        description="host memory a training process frees: keep it for its next allocations (glibc: large blocks from the "
        "never-trimmed heap, not mmap, so a step's large tensors are not page-faulted in again; resident memory stays at its "
        "peak and fragments), return it to the OS at once (the C library's default), or auto: keep unless offload is on, "
        "whose host memory the run budgets (docs/performance.md)",
    )
    loss_chunk: int = Field(
        -1,
        ge=-1,
        description="tokens per chunk of the head's linear + cross-entropy, logits never whole (0: off; -1: when a micro-batch's "
        "float32 logits on a rank exceed 1 GiB, chunks of <= 256 MiB of logits; docs/performance.md)",
    )

    @property
    def end_step(self) -> int:
        """The step this invocation trains to: train.steps, or train.stop_at when it comes first (a sweep's rung)."""
        return min(self.stop_at or self.steps, self.steps)


class CheckpointConfig(Section):
    every: int = Field(200, ge=0, description="checkpoint every N steps (0: only at the end)")
    keep: int = Field(2, ge=1, description="checkpoints kept on disk")
    async_save: bool = Field(True, description="write checkpoints in the background (training waits only for a copy of the state)")
    export: Literal["auto"] | bool = Field(
        "auto",
        description="write consolidated weights (model.safetensors) at the end: true, "
        "false, or auto (unless offloaded: a model streamed from disk is never gathered whole)",
    )


class RunConfig(Section):
    dir: str | None = Field(None, description="run directory (default runs/<timestamp>)")
    progress: bool = Field(True, description="show a progress bar on rank 0")
    timeout_s: float = Field(300.0, gt=0, description="longest wait on another process before failing")
    tensorboard: Literal["auto"] | bool = Field("auto", description="also write the metrics as TensorBoard event files (auto: if installed)")
    kwh_price: float | None = Field(None, ge=0, description="price of a kWh: the summary's energy (RAPL/NVML, where readable) gets a cost")


# a storage tier (parallel/zero/tiers.py): device, host, disk; `none` and `cpu` are the older spellings of device and host
Tier = Literal["device", "host", "none", "cpu", "disk"]


class ElasticConfig(Section):
    replan: bool = Field(
        False,
        description="a restart on a world size other than the checkpoint's runs the planner's plan for it (rank 0 plans, every rank runs it)",
    )


class OffloadConfig(Section):
    """Where model states live (offload/): each of parameters, gradients and optimizer state on a tier, streamed per unit."""

    params: Tier = Field(
        "device", description="parameters: device (device memory), host (host memory), disk (offload.dir); none, cpu: older spellings"
    )
    grads: Literal["auto"] | Tier = Field(
        "auto", description="gradients kept between micro-batches or until a deferred step (auto: the parameters' tier)"
    )
    optimizer: Tier = Field("device", description="Adam moments (a tier, as offload.params)")
    dir: str | None = Field(None, description="scratch directory of the disk tier (default <run.dir>/offload-scratch); never a checkpoint")
    prefetch: int = Field(2, ge=0, description="units read ahead by the I/O threads")
    io_threads: int = Field(2, ge=1, description="background threads that read, write back and step units")
    order: Literal["harmony", "naive"] = Field(
        "harmony",
        description="harmony: every micro-batch through a resident unit before "
        "it is evicted (bytes per step independent of micro-batches); naive: micro-batch by micro-batch",
    )
    step: Literal["auto", "fused", "deferred"] = Field(
        "auto",
        description="fused: a unit steps as soon as its gradient is complete "
        "(needs train.grad_clip=0); deferred: at its next fetch, once the clipped norm is known; auto",
    )
    optimizer_bits: Literal[32, 8] = Field(32, description="8: Adam moments in 8-bit blocks (bitsandbytes; pip install -e .[offload])")
    commit: Literal["link", "journal"] = Field(
        "link",
        description="how a disk-tier run survives a kill: link (checkpoints hard-link the scratch; 2x the state on disk "
        "once it writes on) or journal (each step committed through a gradient log, the scratch resumable in place)",
    )
    max_memory_gb: float | None = Field(None, gt=0, description="memory budget per rank for states, buffers and activations (GiB)")

    @property
    def enabled(self) -> bool:
        """Whether the streaming runtime runs: any state placed on a tier, or 8-bit moments."""
        return any(t not in ("device", "none", "auto") for t in (self.params, self.grads, self.optimizer)) or self.optimizer_bits == 8

    def scratch_dir(self, run_dir: str | None) -> Path:
        """`offload.dir`, or `<run.dir>/offload-scratch`."""
        return Path(self.dir).expanduser() if self.dir else Path(run_dir or "runs") / "offload-scratch"

    @property
    def grads_tier(self) -> str:
        return self.params if self.grads == "auto" else self.grads


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Llama-family attention and MLP


class LoRAConfig(Section):
    """Low-rank adapters (models/lora.py): the base model frozen, W x + (alpha / rank) B A x trained in float32."""

    enabled: bool = Field(False, description="train LoRA adapters instead of the whole model")
    rank: int = Field(8, ge=1, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the adapter's output is multiplied by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: tuple[str, ...] = Field(LORA_TARGETS, min_length=1, description="linear modules to adapt: names or dotted suffixes (PEFT's rule)")
    base_bits: Literal[32, 8] = Field(32, description="8: the frozen base's block linears in int8, a scale per output channel (QLoRA-style)")


class FinetuneConfig(Section):
    """Parameter-efficient fine-tuning: LoRA for training, a PEFT adapter folder applied to the base for generation."""

    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    adapter: str | None = Field(None, description="a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) applied for generation")


class Config(Section):
    model: GPTConfig = Field(default_factory=GPTConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelPlan = Field(default_factory=ParallelPlan)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    hf: HFConfig = Field(default_factory=HFConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    elastic: ElasticConfig = Field(default_factory=ElasticConfig)

    @model_validator(mode="before")
    @classmethod
    def _shape_from_hf_weights(cls, data: Any) -> Any:
        """With hf.weights, the model's shape is the one its config.json describes; a shape option that disagrees with
        it is refused (the weights would not fit), as is an hf.* option that does."""
        if not isinstance(data, dict):
            return data
        given = _as_dict(data.get("hf"))  # a section may be given as an instance
        weights = given.get("weights")
        model_given = _as_dict(data.get("model"))
        moe_given = _as_dict(model_given.get("moe"))  # model.moe: the experts the weights have, the routing the user asks
        if not weights:  # a transformers MoE family's objective, unless the user sets its fields
            objective = moe_objective_of(given.get("arch"))
            return {**data, "model": {**model_given, "moe": {**objective, **moe_given}}} if objective else data
        arch, model, hf = shape_from_weights(weights)
        objective = model.pop("moe_objective", {})
        for section, theirs, ours in (
            ("hf", {"arch": arch, **hf}, given),
            ("model", model, model_given),
            ("model.moe", model.pop("moe", {}), moe_given),
        ):
            for key, value in theirs.items():
                if ours.get(key) is not None and ours[key] != value:
                    raise BehemothError(
                        f"{section}.{key}={ours[key]} but hf.weights={weights} has {key}={value}", f"set {section}.{key}={value} or drop it"
                    )
            if section == "model.moe" and theirs:
                model["moe"] = {**objective, **moe_given, **theirs}
        return {**data, "model": {**model_given, **model}, "hf": {**given, **hf, "arch": arch}}

    @model_validator(mode="after")
    def _check_lengths(self) -> Config:
        if self.train.seq_len is not None and self.train.seq_len > self.model.context:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.context={self.model.context}; lower train.seq_len or raise model.context"
            )
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> Config:
        """LoRA composes with dp, ZeRO 1-3, tp and pp, and offload of the frozen base (with dp and tp)."""
        lora, plan = self.finetune.lora, self.parallel
        others = plan.tp > 1 or plan.pp > 1 or plan.zero_stage == 3 or self.offload.enabled
        if lora.enabled and lora.base_bits == 8 and others:
            raise ValueError(
                "finetune.lora.base_bits=8 runs with data parallelism and ZeRO 0-2 only; set parallel.tp/pp=1, zero_stage<=2, no offload"
            )
        return self

    @property
    def offload_streams(self) -> bool:
        """Whether offload's streaming runtime runs: some state on a tier, other than ZeRO-Offload (ZeRO 1-2 with only
        the float32 moments in host memory, which the ZeRO sync keeps there: nothing streams)."""
        off = self.offload
        moments_only = off.params in ("device", "none") and off.grads_tier in ("device", "none") and off.optimizer in ("host", "cpu")
        return off.enabled and not (self.parallel.zero_stage in (1, 2) and moments_only and off.optimizer_bits == 32)

    def replace(self, **sections: Any) -> Config:
        """A copy with the given sections (instances or dicts of the fields to set) replaced, validated as a whole."""
        data = {k: _as_dict(getattr(self, k)) for k in type(self).model_fields}
        for name, value in sections.items():
            if name not in data:
                raise BehemothError(f"unknown config section {name}", f"known: {', '.join(data)}")
            data[name] = _as_dict(value) if isinstance(value, BaseModel) else {**data[name], **value}
        return validate(data)

    @property
    def tokenizer_folder(self) -> str | None:
        """The folder whose tokenizer encodes the corpus: data.tokenizer, or hf.weights when it holds tokenizer files; None: bytes."""
        given = self.data.tokenizer
        if given == "bytes":
            return None
        if given is not None:
            if not has_tokenizer(given):
                raise BehemothError(
                    f"data.tokenizer={given} holds no tokenizer files", "point it at a save_pretrained folder, or use data.tokenizer=bytes"
                )
            return given
        return self.hf.weights if has_tokenizer(self.hf.weights) else None

    def prepare_corpus(self, *, progress: bool = False) -> Corpus:
        """The configured corpus, tokenized (once: cached) with the configured tokenizer."""
        data = self.data
        sources = [SourceSpec(s.path, s.weight, s.field) for s in data.sources or []]
        return prepare_corpus(
            data.path,
            data.val_fraction,
            data.cache_dir,
            sources=sources or None,
            tokenizer=self.tokenizer_folder,
            field=data.field,
            loss_on=data.loss_on,
            workers=data.workers,
            progress=progress,
        )

    def corpus_split(self, corpus: Corpus, name: str) -> Split:
        """A split of the corpus weighted by the configured mixture, packed as data.packing says."""
        documents = self.data.packing == "document" or (self.data.packing == "auto" and bool(corpus.meta.get("masked")))
        return corpus.split(name, [s.weight for s in self.data.sources] if self.data.sources else None, documents=documents)

    @property
    def seq_len(self) -> int:
        return self.train.seq_len or self.model.context

    def batch_layout(self, dims: ParallelDims) -> BatchLayout:
        """How a step's global batch splits over the ranks that see different tokens (dp x ep: experts route different
        tokens) and micro-batches (parallel.microbatches or train.micro_batch); the same split for runtime and planner."""
        train, ranks = self.train, dims.data_ranks
        return BatchLayout.resolve(train.global_batch, self.parallel.micro_batch(train.global_batch, train.micro_batch, ranks), ranks)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _as_dict(section: Any) -> dict[str, Any]:
    """A config section given as a dict, a validated instance (the fields it was given) or nothing, as a dict."""
    if isinstance(section, BaseModel):
        return section.model_dump(exclude_unset=True)
    return dict(section or {})


def default_run_dir() -> str:
    """runs/<timestamp>, or runs/<timestamp>-2, -3, ... when a run started in the same second holds that name."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise BehemothError(f"config file {p} does not exist", "pass an existing YAML file to --config")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise BehemothError(f"config file {p} is not valid YAML ({err.__class__.__name__})", "fix the syntax") from err
        if not isinstance(raw, dict):
            raise BehemothError(f"config file {p} holds a {type(raw).__name__}, not a mapping", "write `section: {key: value}`")
    for item in overrides:
        apply_override(raw, item)
    return validate(raw)


def validate(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise BehemothError(describe_validation_error(err, raw)) from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set one dotted key in a nested dict; `model=NAME` is short for `model.preset=NAME` (`model=hf:ARCH`: hf.arch=ARCH)."""
    if "=" not in item:
        raise BehemothError(f"option {item!r} is not key=value", "write e.g. train.steps=100 (see behemoth train --help)")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if parts == ["model"] and text.strip().startswith("hf:"):
        parts, text = ["hf", "arch"], text.strip()[3:]
    elif parts == ["model"]:
        parts = ["model", "preset"]
    check_key(parts)
    value = yaml.safe_load(text) if text.strip() else None
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise BehemothError(f"{key}: {part} is not a section", "override a leaf key such as train.steps")
    node[parts[-1]] = value


def check_key(parts: list[str]) -> None:
    """Refuse an unknown section or field, suggesting the closest real one."""
    model: type[BaseModel] = Config
    for depth, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            known = ".".join(parts[:depth])
            choices = [f"{known}.{f}" if known else f for f in fields]
            guess = difflib.get_close_matches(".".join(parts[: depth + 1]), choices, n=1)
            hint = f"did you mean {guess[0]}?" if guess else f"known keys: {', '.join(choices)}"
            raise BehemothError(f"unknown option {'.'.join(parts)}", hint)
        annotation = fields[part].annotation
        if depth < len(parts) - 1:
            if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
                raise BehemothError(f"unknown option {'.'.join(parts)}: {'.'.join(parts[: depth + 1])} is not a section")
            model = annotation


def unknown_option(key: str) -> str:
    """`unknown option KEY` and, where a real key is close, the suggestion `check_key` makes on the command line."""
    try:
        check_key(key.split("."))
    except BehemothError as err:
        return str(err)
    return f"unknown option {key}"


def describe_validation_error(err: ValidationError, raw: dict[str, Any]) -> str:
    """One line per bad value: `key=value: what is wrong`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(unknown_option(loc))
        elif loc:
            lines.append(f"{loc}={e.get('input')!r}: {msg}")
        else:
            lines.append(msg)
    return "; ".join(lines)
