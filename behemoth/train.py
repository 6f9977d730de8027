"""The training loop: data, learning-rate schedule, validation, metrics, checkpoints, progress."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from behemoth.comm import barrier
from behemoth.config import Config
from behemoth.data import BatchSampler, copy_tokenizer
from behemoth.engine import StepResult, build_engine, lr_at
from behemoth.errors import BehemothError
from behemoth.faults import checkpoint as ckpt_io
from behemoth.faults.preflight import exports
from behemoth.faults.recovery import plan_for_world, restart_count, resume_point, settle_run_dir, torchrun_restart_warning
from behemoth.flight import RECORDER, nccl_flight_env
from behemoth.inference.adapters import save_run_adapter
from behemoth.metrics import MetricsLog, gather_floats, measure_peak_tflops, memory_mb, peak_source, plot_loss, synchronize, tensorboard_available
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.gemm import describe as gemm_description
from behemoth.offload import persist
from behemoth.offload.optimizer import EIGHT_BIT
from behemoth.offload.runtime import OffloadSync
from behemoth.parallel.compile import CLOCK, compile_cache_dir
from behemoth.planner.feasibility import describe_plan, refuse
from behemoth.planner.replan import agreed_plan
from behemoth.profiler.energy import read_counters, run_energy
from behemoth.topology import Runtime, init_runtime, join_process_group, pick_device

TRAIN_STREAM, VAL_STREAM = 0, 1
if tensorboard_available():  # imported with the trainer, so that workers forked from a process that loaded it share it
    import torch.utils.tensorboard  # noqa: F401


class Trainer:
    """One rank's view of a training run."""

    def __init__(self, cfg: Config, rt: Runtime, *, resume: Path | None = None) -> None:
        self.cfg, self.rt = cfg, rt
        self.run_dir = Path(cfg.run.dir or "runs/unnamed")
        corpus = cfg.prepare_corpus(progress=cfg.run.progress and rt.is_main)
        problem = corpus.vocab_problem(cfg.model.vocab_size)
        if problem:
            raise BehemothError(problem)
        self.layout = cfg.batch_layout(rt.dims)  # the batch splits over dp x ep (experts route different tokens)
        dp_rank = rt.data_rank()
        self.engine = build_engine(cfg, rt, resume=resume is not None)
        self.train_data = BatchSampler(cfg.corpus_split(corpus, "train"), cfg.seq_len, self.layout, dp_rank, cfg.train.seed, TRAIN_STREAM)
        val_data = BatchSampler(cfg.corpus_split(corpus, "val"), cfg.seq_len, self.layout, dp_rank, cfg.train.seed, VAL_STREAM)
        self.val_batches = [mb for i in range(cfg.train.eval_batches) for mb in val_data.micro_batches(i)]
        self.history: list[StepResult] = []
        self.mfus: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        self.energy: dict[str, Any] | None = None  # rank 0: the run's energy from this host's counters (profiler/energy.py)
        self.start_step = 0
        self.last_saved = -1
        self.events: list[dict[str, Any]] = []  # resumes, written to metrics.jsonl once it is open
        self.recovered: dict[str, Any] = {}  # the row of the last step a journaled run committed (logged if the kill lost it)
        # in the background unless offloaded: a host copy of the state is what offloading avoids
        self.saver = ckpt_io.CheckpointSaver(
            self.run_dir, keep=cfg.checkpoint.keep, group=rt.world_group, background=cfg.checkpoint.async_save and not cfg.offload.enabled
        )
        self.peak_tflops = cfg.train.peak_tflops * rt.world_size if cfg.train.peak_tflops else self.measure_peak()
        self.peak_source = "train.peak_tflops" if cfg.train.peak_tflops else peak_source(rt.device)
        if resume is not None:  # last: nothing may draw from the RNG between restoring it and the first step
            self.start_step = self.load(resume)
        elif self.journal is not None:  # offload.commit=journal: the drawn scratch is step 0, resumable from the start
            self.journal.journal_start(0, ckpt_io.rng_state())
            self.save_marker(0)
        RECORDER.arm(run_dir=self.run_dir, timeout_s=cfg.run.timeout_s)

    @property
    def journal(self) -> OffloadSync | None:
        """The offloaded sync when its steps are committed through a journal (offload.commit=journal)."""
        sync = self.offload_sync()
        return sync if sync is not None and sync.journal is not None else None

    def load(self, ckpt: Path) -> int:
        t0 = time.perf_counter()
        journaled = self.journal
        if journaled is not None and journaled.journal is not None and journaled.journal.reopening:
            step = self.resume_journal(journaled)
        elif ckpt_io.read_meta(ckpt).get("journal"):
            raise BehemothError(
                f"checkpoint {ckpt} marks a journaled offloaded run (offload.commit=journal) whose state is its scratch, "
                "but the scratch holds no journal to resume",
                "resume with the run's own offload.dir and offload.commit=journal, or start the run again",
            )
        else:
            step = self.load_checkpoint(ckpt)
            if journaled is not None:  # a full checkpoint (a finished run's) becomes the journal's first step
                journaled.journal_start(step, ckpt_io.rng_state())
        self.events.append(
            {
                "step": step,
                "event": "resume",
                "from": ckpt.name if journaled is None or step == self.last_saved else f"{ckpt.name}, journal step {step}",
                "world_size": self.rt.world_size,
                "saved_world_size": ckpt_io.read_meta(ckpt)["world_size"],
                "plan": describe_plan(self.cfg, self.rt.world_size),
                "restart": restart_count(),
                "load_s": time.perf_counter() - t0,
                "time": time.time(),
            }
        )
        return step

    def resume_journal(self, sync: OffloadSync) -> int:
        """A journaled scratch resumed where it was last committed (finishing the step it was applying): its step, with the
        RNG of that step. The checkpoint folders only mark the run; the state is the scratch."""
        record = sync.resume_journal()
        self.recovered = record.metrics
        torch.set_rng_state(record.rng["cpu"])
        if "cuda" in record.rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(record.rng["cuda"])
        self.last_saved = record.step if (ckpt_io.checkpoint_root(self.run_dir) / ckpt_io.step_name(record.step)).is_dir() else -1
        return record.step

    def load_checkpoint(self, ckpt: Path) -> int:
        """Model states, RNG and step from checkpoint `ckpt`; its step."""
        state, sync = self.engine.state_dict(), self.offload_sync()
        across = bool(sync and persist.missing_8bit(state, ckpt, EIGHT_BIT))
        if sync is not None:
            state = self.restore_offloaded(state, ckpt, sync, across)
        ckpt_io.load_checkpoint(state, ckpt, self.rt.world_group)
        self.engine.after_load()
        if across:
            persist.load_8bit_across_layouts(sync, ckpt, EIGHT_BIT)
        if sync is not None:
            persist.forget_views(sync)
        meta = ckpt_io.read_meta(ckpt)
        ckpt_io.restore_rng(ckpt, self.rt.rank, self.rt.world_size, meta["world_size"])
        self.last_saved = meta["step"]
        if self.rt.is_main and ckpt.parent == ckpt_io.checkpoint_root(self.run_dir):
            ckpt_io.point_latest(ckpt)  # the run now stands on this checkpoint: a restart resumes from it, not a later one
        return meta["step"]

    def offload_sync(self) -> OffloadSync | None:
        return next((s for s in self.engine.model.syncs if isinstance(s, OffloadSync)), None)

    def restore_offloaded(self, state: dict[str, Any], ckpt: Path, sync: OffloadSync, across: bool) -> dict[str, Any]:
        """The part of `state` DCP must still load: a checkpoint that linked this layout's scratch files gives them back as
        the scratch (hard links: nothing read, copied or mapped); 8-bit state of another layout is converted after."""
        if across:
            state = {**state, "optim": {k: v for k, v in state["optim"].items() if k not in persist.eight_bit_keys(state, EIGHT_BIT)}}
        files = persist.adoptable(sync, state, ckpt)
        if not files:
            return state
        persist.adopt(files, ckpt)
        return persist.without_backed(state, sync)

    def measure_peak(self) -> float:
        """Sum over ranks of each rank's measured float32 matmul rate (all ranks measure at once)."""
        rates = gather_floats([measure_peak_tflops(self.rt.device)], self.rt.device, self.rt.world_group)
        return sum(r[0] for r in rates)

    def run(self) -> dict[str, Any]:
        cfg, main = self.cfg, self.rt.is_main
        self.compiled_before = CLOCK.total  # this run's compile time is what the clock adds from here
        log = self.open_log()
        if main and self.rt.device.type == "cpu":  # the linears' library (train.gemm), measured once per process
            print(f"behemoth: {gemm_description()}", file=sys.stderr, flush=True)
        tqdm.set_lock(threading.RLock())  # tqdm's default lock is a multiprocessing semaphore, which a killed worker leaks
        bar = tqdm(
            total=cfg.train.end_step,
            initial=self.start_step,
            desc="train",
            unit="step",
            file=sys.stderr,
            disable=not (main and cfg.run.progress),
            dynamic_ncols=True,
        )
        flops_per_token = self.engine.model.lm.flops_per_token(cfg.seq_len)
        flops_per_step = flops_per_token * cfg.train.global_batch * cfg.seq_len
        # the curve starts from the untrained model, or a resumed one from the restored model (a check of the restore)
        val0 = self.validate(self.start_step)
        if log and not log.has_val(self.start_step):
            log.write({"step": self.start_step, "val_loss": val0})
        if log and self.recovered and not log.has_loss(self.start_step):  # a step the journal finished after a kill
            log.write({**self.recovered, "recovered": True})
        for event in self.events if log else ():
            log.write(event)
        counters = read_counters() if main else None  # this host's energy counters (RAPL, NVML), where readable
        for step in range(self.start_step, cfg.train.end_step):
            record = self.train_one(step, flops_per_step)
            done = step + 1
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 or done == cfg.train.end_step:
                record["val_loss"] = self.validate(done)
            if done % cfg.train.log_every == 0 or done == cfg.train.end_step:
                record.update(self.memory_per_rank())
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 or done == cfg.train.end_step:
                record.update(self.save(done))
            if log:
                log.write(record)
            bar.update(1)
            bar.set_postfix(
                loss=f"{record['loss']:.3f}", val=f"{self.val_history[-1][1]:.3f}" if self.val_history else "-", tok_s=f"{record['tokens_per_s']:.0f}"
            )
        bar.close()
        if counters is not None:
            self.energy = run_energy(counters, read_counters(), cfg.run.kwh_price)
            if log and "kwh" in self.energy:  # metrics.jsonl and TensorBoard get it as the last step's scalars
                log.write({"step": cfg.train.end_step, **{f"energy_{k}": self.energy[k] for k in ("joules", "kwh", "cost") if k in self.energy}})
        try:
            return self.finish(log)
        finally:
            self.engine.close()

    def train_one(self, step: int, flops_per_step: float) -> dict[str, Any]:
        lr = lr_at(step, self.cfg.train)
        batches = self.train_data.micro_batches(step)
        synchronize(self.rt.device)
        CLOCK.take()  # compiling outside the step (an evaluation's graph) is counted in the run's total only
        t0 = time.perf_counter()
        result = self.engine.train_step(batches, lr, self.train_data.trained_targets(step))
        if self.journal is not None:  # the step committed, applied, and the scratch's (offload/journal.py)
            row = {"step": step + 1, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm} | ({"skipped": True} if result.skipped else {})
            self.journal.commit_step(step + 1, ckpt_io.rng_state(), row)
            result.metrics.update(self.journal.meter_tiers.metrics())  # the bytes of the step with its apply pass
        synchronize(self.rt.device)
        compile_s = CLOCK.take()  # train.compile: the first step's compilation, reported apart from its time
        dt = time.perf_counter() - t0 - compile_s
        if result.skipped and self.cfg.train.nonfinite == "stop":
            self.stop_nonfinite(step + 1, result)
        self.history.append(result)
        self.mfus.append(flops_per_step / dt / (self.peak_tflops * 1e12))
        record = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            "step_time_s": dt,
            "tokens_per_s": self.engine.tokens_per_step / dt,
            "mfu": self.mfus[-1],
        }
        if self.cfg.train.compile:
            record["compile_s"] = compile_s
        written = self.saver.poll()
        record |= ({"skipped": True} if result.skipped else {}) | ({"ckpt_write_s": written[-1]} if written else {})
        return record | layout_record(
            result.metrics, self.engine.model, every=step + 1 == self.cfg.train.end_step or (step + 1) % self.cfg.train.log_every == 0
        )

    def stop_nonfinite(self, step: int, result: StepResult) -> None:
        """train.nonfinite=stop: end the run in one line; the update was not applied and nothing more is saved."""
        self.saver.wait()  # a save already in flight holds the last good state: let it finish
        last = ckpt_io.checkpoint_root(self.run_dir) / ckpt_io.step_name(self.last_saved) if self.last_saved >= 0 else None
        raise BehemothError(
            f"step {step}: the loss is {result.loss} and the gradient norm {result.grad_norm}: training stopped "
            f"without applying the update or writing a checkpoint",
            (f"resume from {last} " if last else "start again ") + "with a lower train.lr or train.grad_clip, "
            "or set train.nonfinite=skip to skip such steps",
        )

    def memory_per_rank(self) -> dict[str, list[float]]:
        """Every rank's memory, MiB, in one all-gather: peak resident (`memory_mb`), on GPUs peak allocated, the model
        states it holds (parameters + gradients + optimizer state; ZeRO shards them) and, under a pipeline, the
        activations it held at once (measured)."""
        mine = {("memory_mb" if k == "rss_peak_mb" else k): v for k, v in memory_mb(self.rt.device).items()}
        mine["model_states_mb"] = sum(v for k, v in self.engine.model_state_bytes().items() if k in ("params", "grads", "optimizer")) / 2**20
        pipeline = self.engine.model.pipeline
        if pipeline is not None:
            mine["stash_mb"] = pipeline.last_trace.peak_stash_bytes / 2**20
        ranks = gather_floats(list(mine.values()), self.rt.device, self.rt.world_group)
        return {k: [r[i] for r in ranks] for i, k in enumerate(mine)}

    def validate(self, step: int) -> float:
        loss = self.engine.evaluate(self.val_batches)
        self.val_history.append((step, loss))
        return loss

    def save(self, step: int) -> dict[str, float]:
        """Checkpoint step `step` (in the background with checkpoint.async_save); how long training stalled for it."""
        if step == self.last_saved:
            return {}
        if self.journal is not None and step < self.cfg.train.end_step:
            return self.save_marker(step)
        sync = self.offload_sync()
        backing = persist.backing(sync) if sync is not None and sync.policy.uses_disk else None
        stall = self.saver.save(self.engine.state_dict(), step, {"config": self.cfg.model_dump(mode="json")}, backing=backing)
        if sync is not None:
            persist.forget_views(sync)
            sync.keep_scratch = False  # a journaled run's last checkpoint links the scratch: it holds the state from here
        self.last_saved = step
        return {"ckpt_stall_s": stall}

    def save_marker(self, step: int) -> dict[str, float]:
        """offload.commit=journal: a checkpoint folder that holds no model state (the scratch is resumable at its last
        committed step), so that `--resume` and restarts find the run; no second copy of the state."""
        t0 = time.perf_counter()
        meta = {"config": self.cfg.model_dump(mode="json"), "journal": True}
        self.saver.save({"journal": {"step": torch.tensor(step)}}, step, meta)
        self.last_saved = step
        return {"ckpt_stall_s": time.perf_counter() - t0}

    def open_log(self) -> MetricsLog | None:
        if not self.rt.is_main:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(self.cfg.to_yaml())
        if self.cfg.tokenizer_folder:  # the run directory decodes what it generates without the base folder
            copy_tokenizer(self.cfg.tokenizer_folder, self.run_dir)
        # the log continues from where the model stands: a resume (or a restart from scratch) drops what came after it
        board = self.cfg.run.tensorboard
        return MetricsLog(
            self.run_dir / "metrics.jsonl", truncate_after=self.start_step, tensorboard=tensorboard_available() if board == "auto" else board
        )

    @property
    def exports(self) -> bool:
        """checkpoint.export: true, false, or auto (unless offloaded)."""
        return exports(self.cfg)

    def finish(self, log: MetricsLog | None) -> dict[str, Any]:
        """Plot, export consolidated weights from the final checkpoint when asked (tensor by tensor), summarize."""
        self.saver.wait()
        RECORDER.disarm()
        summary = {
            "steps": self.cfg.train.steps,
            "losses": [r.loss for r in self.history],
            "val": self.val_history,
            "run_dir": str(self.run_dir),
            "rank": self.rt.rank,
            "mfu": statistics.median(self.mfus[1:] or self.mfus or [0.0]),
            "peak_tflops": self.peak_tflops,
            "peak_source": self.peak_source,
            "world_size": self.rt.world_size,
            "checkpoint_write_s": list(self.saver.write_s),
            "exported": self.exports and not self.cfg.finetune.lora.enabled,
            "adapter": self.cfg.finetune.lora.enabled,
            "energy": self.energy,
        }
        if self.cfg.train.compile:  # every graph this rank compiled (steps and evaluations), and where the code is cached
            summary |= {"compile_s": CLOCK.total - self.compiled_before, "compile_cache": str(compile_cache_dir())}
        if log is None:
            barrier(self.rt.world_group)
            return summary
        log.close()
        plot_loss(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
        if self.cfg.finetune.lora.enabled:  # the adapters in PEFT's layout; `behemoth export --merge` writes merged weights
            save_run_adapter(ckpt_io.resolve_checkpoint(self.run_dir), self.cfg, self.run_dir / "adapter")
        elif self.exports:
            ckpt = ckpt_io.resolve_checkpoint(self.run_dir)
            ckpt_io.export_safetensors(ckpt, self.run_dir / "model.safetensors", build_causal_lm(self.cfg.model, self.cfg.hf).module)
        barrier(self.rt.world_group)
        return summary


def layout_record(metrics: dict[str, Any], model: Any, *, every: bool) -> dict[str, Any]:
    """A layout's own metrics for the log: offload's bytes per tier every step; a mixture of experts' auxiliary losses
    and dropped fraction every step, tokens per expert and the expert layout in force every log_every steps."""
    out = {k: v for k, v in metrics.items() if k.startswith("offload_")}
    if "aux_loss" in metrics:
        out |= {k: metrics[k] for k in ("aux_loss", "z_loss", "dropped_fraction")}
        if every:
            out["expert_tokens"] = metrics["expert_tokens"]
            if model.experts is not None:
                out["expert_layout"] = f"{model.experts.layout}/{model.experts.chunks}"
    return out


def train(cfg: Config, *, resume: Path | None = None, verified: bool = False, launch_id: str | None = None) -> dict[str, Any]:
    """Run training in this process (one rank of a job, or a whole single-process job). A plan that cannot run on this
    world is refused here too, so a job started by torchrun gets the checks `behemoth train` runs before launch.

    A worker the elastic agent restarted resumes from the run's newest intact checkpoint, on the plan re-made for the
    world it finds (`behemoth.faults.recovery`); `launch_id` names the launch (default: torchrun's rendezvous id, or a new
    one), `verified`: the launcher has already checked `resume`."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    launch_id = launch_id or os.environ.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex
    joined = cfg.elastic.replan and join_process_group(pick_device(int(os.environ.get("LOCAL_RANK", 0))), cfg.run.timeout_s)
    try:
        return train_on(replanned(cfg, world, launch_id), world, resume=resume, verified=verified, launch_id=launch_id)
    finally:
        if joined and dist.is_initialized():
            dist.destroy_process_group()


def replanned(cfg: Config, world: int, launch_id: str) -> Config:
    """The config this start runs: with elastic.replan, rank 0's choice for this world, broadcast (planner/replan.py);
    else the config's own plan with data parallelism absorbing a change of world size."""
    if not cfg.elastic.replan:
        return plan_for_world(cfg, world)
    cfg, line = agreed_plan(cfg, world, launch_id, dist.group.WORLD, dist.get_rank() == 0)
    if line and dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    return cfg


def train_on(cfg: Config, world: int, *, resume: Path | None, verified: bool, launch_id: str) -> dict[str, Any]:
    """`train` once the plan for this world is known."""
    refuse(cfg, world)
    if cfg.run.dir:
        for key, value in nccl_flight_env(cfg.run.dir).items():
            os.environ.setdefault(key, value)
    torch.manual_seed(cfg.train.seed)  # the run's seed for dropout; nothing else reseeds the process-wide RNG
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    try:
        cfg = settle_run_dir(cfg, rt)
        warning = torchrun_restart_warning()
        if warning and rt.is_main:
            print(warning, file=sys.stderr, flush=True)
        return Trainer(cfg, rt, resume=resume_point(cfg, resume, rt, launch_id=launch_id, verified=verified)).run()
    finally:
        RECORDER.disarm()
        rt.close()
