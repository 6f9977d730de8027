"""One trial under Hydra, on the sweep's side: its config, data, spilled shards and the chain of shard tasks its steps
are (forward through the shards, the last shard's forward and backward, backward through the others), with everything
the engine does between steps done as the engine does it: the loss scaled over the step's counted targets, the global
gradient norm summed in the model's parameter order, the clip, AdamW, the LR schedule, validation. So a trial ends with
the losses and weights it has trained alone."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch

from behemoth.config import Config, load_config
from behemoth.data import BatchSampler, copy_tokenizer
from behemoth.engine import lr_at
from behemoth.errors import BehemothError
from behemoth.faults.preflight import exports
from behemoth.metrics import MetricsLog, tensorboard_available
from behemoth.models.causal_lm import CausalLM
from behemoth.models.init import draw_full
from behemoth.models.lora import adapter_parameters
from behemoth.models.peft_io import write_adapter
from behemoth.parallel.clip import clip_coefficient
from behemoth.sweep.hydra import artifacts
from behemoth.sweep.hydra.shards import ShardPlan, plan_shards
from behemoth.sweep.hydra.worker import disk_buffer, trial_model
from behemoth.topology import ParallelDims

Task = dict[str, Any]
Chain = Generator[Task, dict[str, Any], None]
Forward = tuple[list[list[torch.Tensor]], dict[str, Any], list[list[torch.Tensor]] | list[None]]  # kept inputs, the turn, RNG states
TRAIN_STREAM, VAL_STREAM = 0, 1  # as the trainer draws its train and validation batches


def unsupported(cfg: Config) -> str | None:
    """Why hydra cannot run this trial exactly as `behemoth train` would (None: it can)."""
    lora = cfg.finetune.lora
    checks = [
        (any((d or 1) > 1 for d in cfg.parallel.degrees().values()), "a parallel plan (hydra runs each trial's shards one at a time)"),
        (cfg.offload.enabled, "offload (hydra spills the shards itself)"),
        (lora.enabled and lora.base_bits != 32, f"finetune.lora.base_bits={lora.base_bits} (hydra keeps the frozen base in float32)"),
        (cfg.model.moe.enabled, "a mixture of experts"),
        (cfg.train.precision != "fp32", f"precision {cfg.train.precision}"),
    ]
    return next((why for bad, why in checks if bad), None)


def cfg_draws(cfg: Config) -> bool:
    """Whether the trial's training forward draws random numbers (dropout in the model or on LoRA's input)."""
    return cfg.model.dropout_p > 0 or (cfg.finetune.lora.enabled and cfg.finetune.lora.dropout > 0)


class HydraTrial:
    """A trial's spilled state (each shard's flat buffer on the host or on disk) and its chain of tasks."""

    def __init__(self, name: str, run_dir: Path, config: str, budget_bytes: int | None, spill: str) -> None:
        self.name, self.run_dir, self.config = name, run_dir, config
        self.cfg = load_config(config)
        why = unsupported(self.cfg)
        if why:
            raise BehemothError(f"{name}: hydra execution does not run {why}", "run this sweep with sweep.execution=sequential or concurrent")
        lm = trial_model(self.cfg)
        self.plan: ShardPlan = plan_shards(lm, budget_bytes)
        self.adapters = sorted(adapter_parameters(lm.module))  # LoRA's trained parameters (empty: the whole model trains)
        self.host = [self.new_buffer(s.index, s.buffer_numel, spill) for s in self.plan.shards]
        self.step = self.adam_steps = 0
        self.draws = cfg_draws(self.cfg)  # dropout: the trial carries the CPU generator from task to task
        self.rng = torch.Generator().manual_seed(self.cfg.train.seed).get_state()  # as `behemoth train` seeds it
        self.pending: list[dict[str, Any] | None] = [None] * len(self.plan.shards)
        if not self.restore():
            self.initialize(lm)
        corpus = self.cfg.prepare_corpus(progress=False)
        problem = corpus.vocab_problem(self.cfg.model.vocab_size)
        if problem:
            raise BehemothError(problem)
        layout = self.cfg.batch_layout(ParallelDims(1))
        self.train_data = BatchSampler(self.cfg.corpus_split(corpus, "train"), self.cfg.seq_len, layout, 0, self.cfg.train.seed, TRAIN_STREAM)
        val = BatchSampler(self.cfg.corpus_split(corpus, "val"), self.cfg.seq_len, layout, 0, self.cfg.train.seed, VAL_STREAM)
        self.val_batches = [mb for i in range(self.cfg.train.eval_batches) for mb in val.micro_batches(i)]
        self.busy_s = 0.0

    def new_buffer(self, index: int, numel: int, spill: str) -> torch.Tensor:
        if spill == "disk":
            self.spill_dir = self.run_dir / "hydra" / "spill"
            return disk_buffer(self.spill_dir / f"shard_{index}.bin", numel)
        return torch.zeros(numel).share_memory_()

    def handle(self, index: int) -> Any:
        """What a worker opens to reach shard `index`: the shared tensor, or its file and size."""
        buf = self.host[index]
        return (self.spill_dir / f"shard_{index}.bin", buf.numel()) if hasattr(self, "spill_dir") else buf

    def key(self, index: int) -> str:
        """The name a worker knows shard `index`'s buffer by, once it has been handed to it."""
        return f"{self.name}/{index}"

    def buffers(self) -> dict[str, Any]:
        return {self.key(i): self.handle(i) for i in range(len(self.host))}

    def initialize(self, lm: CausalLM) -> None:
        """Every parameter as the trial's own run gives it, straight into its shard's buffer (one parameter at a time,
        never the whole model): with hf.weights, the folder's tensors (its own run draws them first and reads the folder
        over them), the rest (LoRA's adapters, or every parameter without a folder) drawn from (seed, name)."""
        where = self.locations()
        stored = {n: v for n, v in where.items() if n not in self.adapters} if lm.weights else {}
        for name, view in where.items():
            if name not in stored:
                view.copy_(draw_full(lm.init_spec(name), tuple(view.shape), self.cfg.train.seed, name))
        if lm.weights:
            from behemoth.models.hf import load_weights

            load_weights(lm.module, lm.weights, params=stored)  # refuses a folder that lacks one of them

    def locations(self) -> dict[str, torch.Tensor]:
        """Every parameter's value as a view into its shard's spilled buffer, by its single-process name."""
        out = {}
        for shard, buf in zip(self.plan.shards, self.host):
            for name, (offset, shape) in shard.locations().items():
                out[name] = buf[offset : offset + math.prod(shape)].view(shape)
        return out

    @property
    def state_path(self) -> Path:
        return self.run_dir / "hydra" / "state.pt"

    def restore(self) -> bool:
        """Continue from the state saved at the end of the trial's last segment (a resumed sweep), if there is one."""
        if not self.state_path.is_file():
            return False
        state = torch.load(self.state_path, weights_only=True)
        for buf, saved in zip(self.host, state["shards"]):
            buf.copy_(saved)
        self.step, self.adam_steps = state["step"], state["adam_steps"]
        self.rng = state.get("rng", self.rng)
        self.pending = state.get("pending", self.pending)
        return True

    def save(self) -> None:
        """The shards' states, the optimizer steps they take when next loaded, and the step, written atomically: where a
        resumed sweep continues (hydra/latest names the step, for the sweep to say where)."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        state = {"step": self.step, "adam_steps": self.adam_steps, "rng": self.rng, "pending": self.pending, "shards": [b.clone() for b in self.host]}
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)
        (self.run_dir / "hydra" / "latest").write_text(f"step_{self.step:07d}\n")

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter by its single-process name (copies), from the spilled shards."""
        return {name: view.clone() for name, view in self.locations().items()}

    def export(self) -> None:
        """What the trial's own run writes at its end: a LoRA run its adapters (PEFT's layout, `adapter/`), another its
        consolidated weights (model.safetensors) when checkpoint.export asks."""
        if self.adapters:
            weights = self.weights()
            write_adapter(self.run_dir / "adapter", {n: weights[n] for n in self.adapters}, self.cfg.finetune.lora, self.cfg.hf.weights)
        elif exports(self.cfg):
            from safetensors.torch import save_file

            save_file(self.weights(), str(self.run_dir / "model.safetensors"))

    def task(self, kind: str, index: int, **fields: Any) -> Task:
        shard = self.plan.shards[index]
        borrow = None
        if shard.borrowed:
            offset, shape = self.plan.shards[0].locations()[shard.borrowed]
            borrow = (self.key(0), offset, shape, self.plan.borrowed_copies)
        out = {"kind": kind, "shard": shard, "host": self.key(index), "borrow": borrow, "config": self.config, "pending": self.pending[index]}
        self.pending[index] = None  # the worker applies it as it loads the shard
        return out | fields

    def chain(self, stop_at: int) -> Chain:
        """The tasks of this trial up to step `stop_at`: validation at the start (unless logged), then each step."""
        end = min(stop_at, self.cfg.train.steps)
        log = self.open_log()
        artifacts.log_lines(self.run_dir, self.launch_line(stop_at))
        try:
            if not log.has_val(self.step):
                log.write({"step": self.step, "val_loss": (yield from self.validate())})
            train = self.cfg.train
            while self.step < end:
                record = yield from self.train_step(self.step)
                self.step += 1
                if train.eval_every and self.step % train.eval_every == 0 or self.step == end:
                    record["val_loss"] = yield from self.validate()
                log.write(record)
                if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0 and self.step < end:
                    self.save()  # checkpoint.every: where a killed sweep resumes this trial
        finally:
            log.close()
        self.save()
        if self.step == self.cfg.train.steps:
            self.export()
        artifacts.segment_done(self.run_dir, self.busy_s)

    def launch_line(self, stop_at: int) -> str:
        """What a segment is about to run: the model, its shards against the budget and where they wait, batch, steps."""
        cfg, plan = self.cfg, self.plan
        name = f"hf:{cfg.hf.arch}" if cfg.hf.arch else cfg.model.preset
        params = sum(s.parameters_numel for s in plan.shards)
        budget = f"a {plan.budget_bytes / 2**20:.3g} MiB budget" if plan.budget_bytes else "no budget"
        where = "disk" if hasattr(self, "spill_dir") else "host memory"
        return (
            f"behemoth: hydra: {name} ({params / 1e6:.2f}M parameters), {len(plan.shards)} shards under {budget} "
            f"({plan.state_bytes / 2**20:.2f} MiB of states, spilled to {where}), batch {cfg.train.global_batch}x{cfg.seq_len} "
            f"tokens, steps {self.step} -> {min(stop_at, cfg.train.steps)} -> {self.run_dir}"
        )

    def failed(self, error: str, trace: str) -> None:
        """A segment ended by an error: said in train.log (with the traceback of where it was raised) and loss.png."""
        artifacts.segment_failed(self.run_dir, error, trace)

    def release(self) -> None:
        """The trial is done or failed: its spilled shards go (their files too; hydra/state.pt keeps where it ended)."""
        self.host = []
        if hasattr(self, "spill_dir"):
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # hydra/ itself, unless state.pt is in it
                self.spill_dir.parent.rmdir()

    def open_log(self) -> MetricsLog:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())
        if self.cfg.tokenizer_folder:  # as the trial's own run: its directory decodes what it generates on its own
            copy_tokenizer(self.cfg.tokenizer_folder, self.run_dir)
        board = self.cfg.run.tensorboard
        return MetricsLog(self.run_dir / "metrics.jsonl", truncate_after=self.step, tensorboard=tensorboard_available() if board == "auto" else board)

    def validate(self) -> Generator[Task, dict[str, Any], float]:
        """The engine's evaluation: every validation batch forward, shard after shard; mean token loss."""
        h: list[torch.Tensor] = [x for x, _ in self.val_batches]
        for s in range(len(self.plan.shards)):
            result = yield self.task("validate", s, inputs=h, targets=[y for _, y in self.val_batches])
            h = result.get("outputs", h)
        total, count = result["stats"]
        return total / count

    def train_step(self, step: int) -> Generator[Task, dict[str, Any], dict[str, Any]]:
        """One optimizer step as tasks: forward through shards 0..S-2 (their inputs kept), the last shard's turn, backward
        through S-2..0; then the gradient norm and the step that each shard takes as it is next loaded."""
        t0, busy0 = time.time(), self.busy_s
        batches, train = self.train_data.micro_batches(step), self.cfg.train
        scale = max(1, self.train_data.trained_targets(step))
        last = len(self.plan.shards) - 1
        kept, turn, states = yield from (self.forward_drawing if self.draws else self.forward_all)(batches, scale)
        squares, grads, tied = {last: turn["squares"]}, turn["grad_inputs"], turn["tied_grads"]
        for s in reversed(range(last)):
            if s == 0 and not self.plan.shards[0].numel and tied[0] is None:
                squares[s] = []  # token ids in, nothing trained (LoRA's frozen embedding): no backward to run
                continue
            result = yield self.task(
                "backward", s, inputs=kept[s], grad_outputs=grads, tied_grads=tied if s == 0 and tied[0] is not None else None, rngs=states[s]
            )
            squares[s], grads = result["squares"], result["grad_inputs"]
        loss = torch.zeros(())
        for value in turn["losses"]:
            loss += torch.tensor(value)
        lr = lr_at(step, train)
        norm = self.grad_norm(squares)
        self.schedule_update(norm, lr, step)
        busy = self.busy_s - busy0
        return {"step": step + 1, "loss": float(loss), "lr": lr, "grad_norm": norm, "step_time_s": busy, "wall_s": time.time() - t0}

    def forward_all(self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: int) -> Generator[Task, dict[str, Any], Forward]:
        """Forward through shards 0..S-2, every micro-batch in one task a shard, then the last shard's turn (forward,
        loss, backward): each shard's kept inputs, the turn's answer."""
        last = len(self.plan.shards) - 1
        kept, h = [], [x for x, _ in batches]
        for s in range(last):
            kept.append(h)
            h = (yield self.task("forward", s, inputs=h))["outputs"]
        turn = yield self.task("turn", last, inputs=h, targets=[y for _, y in batches], scale=scale)
        return kept, turn, [None] * last

    def forward_drawing(self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: int) -> Generator[Task, dict[str, Any], Forward]:
        """With dropout: micro-batch after micro-batch through every shard and the turn, the order in which the whole
        model draws its masks, the CPU generator's state carried from task to task (and kept per shard and micro-batch
        for the recompute in backward, which draws the same masks again)."""
        last = len(self.plan.shards) - 1
        kept: list[list[torch.Tensor]] = [[] for _ in range(last)]
        states: list[list[torch.Tensor]] = [[] for _ in range(last)]
        turns = []
        for x, y in batches:
            h = x
            for s in range(last):
                kept[s].append(h)
                states[s].append(self.rng)
                out = yield self.task("forward", s, inputs=[h], rngs=[self.rng])
                h, self.rng = out["outputs"][0], out["rng"]
            turns.append((yield self.task("turn", last, inputs=[h], targets=[y], scale=scale, rngs=[self.rng])))
            self.rng = turns[-1]["rng"]
        merged = {key: [v for t in turns for v in t[key]] for key in ("losses", "grad_inputs", "tied_grads")}
        return kept, merged | {"squares": turns[-1]["squares"]}, states

    def grad_norm(self, squares: dict[int, list[float]]) -> float:
        """The global norm as the engine sums it: |g|^2 of every parameter, in the model's order, into a float32 total."""
        total = torch.zeros((), dtype=torch.float32)
        for s in sorted(squares):
            for value in squares[s]:
                total += torch.tensor(value, dtype=torch.float32) * 1.0
        return float(total.sqrt())

    def schedule_update(self, norm: float, lr: float, step: int) -> None:
        """Every shard's step (clip coefficient, learning rate, AdamW count), taken when the shard is next loaded; a
        non-finite norm skips it (train.nonfinite=skip) or ends the trial as its own run would."""
        train = self.cfg.train
        if not math.isfinite(norm):
            if train.nonfinite == "stop":
                raise BehemothError(
                    f"step {step + 1}: the gradient norm is {norm}: training stopped without applying the update",
                    "lower train.lr or train.grad_clip, or set train.nonfinite=skip to skip such steps",
                )
            self.pending = [{"apply": False} for _ in self.pending]
            return
        self.adam_steps += 1
        coef = float(clip_coefficient(torch.tensor(norm, dtype=torch.float32), train.grad_clip)) if train.grad_clip > 0 else None
        self.pending = [{"apply": True, "coef": coef, "lr": lr, "adam_step": self.adam_steps - 1} for _ in self.pending]

    def remaining(self, stop_at: int) -> dict[tuple[str, int], int]:
        """Tasks left to `stop_at`, by (kind, shard): what the scheduler prices with the times it has measured."""
        end, shards = min(stop_at, self.cfg.train.steps), len(self.plan.shards)
        steps = max(0, end - self.step)
        every = self.cfg.train.eval_every
        evals = (steps // every if every else 0) + 1
        out = {("validate", s): evals for s in range(shards)}
        per_step = self.cfg.batch_layout(ParallelDims(1)).accum if self.draws else 1  # forward tasks a shard a step
        for s in range(shards - 1):
            out[("forward", s)], out[("backward", s)] = steps * per_step, steps
        out[("turn", shards - 1)] = steps * per_step
        return out
