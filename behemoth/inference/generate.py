"""The Python API of generation: a model, a paged KV cache and a scheduler on the scheduling rank.

    gen = behemoth.inference.load("runs/20261130-075637")          # one process
    out = gen.generate(["def main(", "import "], SamplingParams(max_tokens=32))
    print(out[0].text)

`Generator` batches the prompts through the same continuous-batching scheduler the server runs, so a
batch of prompts of different lengths is one padded prefill and then one token per prompt per step.
Under tensor or pipeline parallelism the scheduling rank's runner sends every step to the other ranks
(`runner.follow`); `generate_on_ranks` is that job's entry point.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, KVStorage, blocks_for_memory
from behemoth.inference.loading import Source, load_model, resolve_source
from behemoth.inference.lora_bank import LoRABank
from behemoth.inference.ngram import NgramDraft, NgramProposer
from behemoth.inference.offload import MeasuredTier, OffloadPolicy, StreamedModel, load_offloaded
from behemoth.inference.runner import DistributedRunner, ModelRunner, Runner, cache_layout, follow, head_split, module_dtype
from behemoth.inference.sampling import SamplingParams
from behemoth.inference.scheduler import Request, Scheduler, SchedulerPolicy
from behemoth.inference.server import ServeLimits
from behemoth.inference.serving import EngineLoop
from behemoth.inference.speculative import SpeculativeDecoder
from behemoth.inference.text import Tokenizer, encode_prompt, tokenizer_for
from behemoth.parallelize import ParallelModel
from behemoth.topology import Runtime, init_runtime, one_rank_runtime

LoadedModel = ParallelModel | StreamedModel  # in memory (laid out by parallelize) or with its blocks on a tier


@dataclass(frozen=True)
class CachePolicy:
    """The paged KV cache: tokens per block and the memory per rank its blocks may take; and how the runner's one-call
    decode step (fast_decode.py) runs batch-1 products."""

    block_size: int = 16
    memory_mb: float = 256.0
    max_blocks: int | None = None  # at most this many blocks (None: as many as memory_mb holds)
    split_products: bool = False  # each batch-1 decode product on two threads (--split-products); torch then runs one intra-op thread
    decode_lanes: bool = True  # decode steps attend to dense per-request lanes, not a gather of the blocks (decode_lanes.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or not self.memory_mb > 0:
            raise BehemothError(
                f"a KV cache of {self.memory_mb} MiB in blocks of {self.block_size} tokens",
                "use a positive --kv-cache-mb and a --block-size of at least 1",
            )

    def for_batch(self, prompt_lengths: list[int], max_tokens: list[int]) -> CachePolicy:
        """This cache capped at the blocks these prompts fill together when every one runs to max_tokens: a one-shot
        batch then allocates (and keeps resident) no block it cannot use, and is never preempted."""
        need = sum(-(-(n + m) // self.block_size) for n, m in zip(prompt_lengths, max_tokens))
        return replace(self, max_blocks=max(1, need))


@dataclass(frozen=True)
class DraftModel:
    """A draft model for speculative decoding: its runner over its own KV storage, its blocks, tokens it proposes per step."""

    runner: ModelRunner
    num_blocks: int
    tokens: int = 4


@dataclass(frozen=True)
class Completion:
    """One prompt's generation."""

    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    time_to_first_token_s: float
    latency_s: float


def held_layers(model: LoadedModel) -> tuple[int, ...]:
    """The layer indices this rank runs: every layer, or its pipeline stages' blocks."""
    if model.pipeline is None:
        return tuple(range(model.lm.shape.n_layer))
    return tuple(i for stage in model.pipeline.stages.values() for i in stage.blocks)


def local_runner(model: LoadedModel, cache: CachePolicy) -> ModelRunner:
    """This rank's runner: its layers, its heads of the KV cache, as many blocks as `cache.memory_mb` holds (an
    offloaded model's runner streams its blocks)."""
    layers, heads = held_layers(model), head_split(model.tp, model.rt.dims.tp)
    dtype = module_dtype(model.module) if isinstance(model, ParallelModel) else torch.float32  # streamed units are float32
    probe = cache_layout(model.lm, layers=layers, tp=heads, block_size=cache.block_size, num_blocks=1, dtype=dtype)
    blocks = min(blocks_for_memory(int(cache.memory_mb * 2**20), probe.bytes_per_block), cache.max_blocks or 1 << 62)
    layout = cache_layout(model.lm, layers=layers, tp=heads, block_size=cache.block_size, num_blocks=blocks, dtype=probe.dtype)
    storage = KVStorage(layout, model.rt.device)
    if isinstance(model, StreamedModel):
        return model.runner(storage)
    runner = ModelRunner(model.lm, storage, tp=model.tp, device=model.rt.device)
    runner.split_products = cache.split_products
    runner.decode_lanes = cache.decode_lanes
    if cache.split_products:  # its two halves are the two threads (this one, an inter-op worker): no intra-op workers
        torch.set_num_threads(1)  # competing with them for the cores (measured: they cost more than they give)
    return runner


class Generator:
    """Prompts in, completions out, on the scheduling rank of a loaded model."""

    def __init__(
        self,
        runner: Runner,
        *,
        num_blocks: int,
        block_size: int,
        context: int,
        tokenizer: Tokenizer | None,
        eos_token_ids: list[int] = (),
        max_batch: int = 64,
        draft: DraftModel | NgramDraft | None = None,
    ) -> None:
        self.runner, self.tokenizer, self.eos_token_ids, self.draft = runner, tokenizer, list(eos_token_ids), draft
        self.num_blocks, self.block_size, self.context, self.max_batch = num_blocks, block_size, context, max_batch
        self.stats: dict[str, int] = {}  # the last generate()'s scheduler counters (steps, tokens, preemptions)

    def scheduler(self, policy: SchedulerPolicy | None = None) -> Scheduler:
        """A scheduler over a fresh block table of this generator's cache."""
        policy = policy or SchedulerPolicy(max_batch=self.max_batch, context=self.context, max_waiting=1 << 30)
        speculative = None
        if isinstance(self.draft, NgramDraft):
            speculative = SpeculativeDecoder(NgramProposer(self.draft), k=self.draft.tokens)
        elif self.draft is not None:
            speculative = SpeculativeDecoder(self.draft.runner, BlockAllocator(self.draft.num_blocks, self.block_size), self.draft.tokens)
        return Scheduler(self.runner, BlockAllocator(self.num_blocks, self.block_size), policy, self.tokenizer, speculative)

    def with_eos(self, params: SamplingParams, ignore_eos: bool = False) -> SamplingParams:
        """The model's end-of-sequence ids as stop tokens, unless the request names its own or ignores them."""
        if ignore_eos or params.stop_token_ids or not self.eos_token_ids:
            return params
        return params.model_copy(update={"stop_token_ids": self.eos_token_ids})

    def encode(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(prompt, self.tokenizer, self.runner.vocab_size)

    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None, *, ignore_eos: bool = False
    ) -> list[Completion]:
        """Generate for every prompt (text or token ids), batched; one Completion per prompt, in order."""
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise BehemothError(f"{len(prompts)} prompts but {len(params)} sampling parameters", "give one per prompt, or one for all")
        sched = self.scheduler()
        requests = [sched.submit(self.encode(p), self.with_eos(sp, ignore_eos)) for p, sp in zip(prompts, params)]
        sched.run_until_done()
        self.stats = dict(sched.stats)
        return [completion(r) for r in requests]

    def engine(self, policy: SchedulerPolicy) -> EngineLoop:
        """The serving engine over this generator's model and cache (not started)."""
        return EngineLoop(self.scheduler(policy), self.runner)

    def limits(self, model_name: str, max_tokens: int) -> ServeLimits:
        """What a served request may ask of this model."""
        return ServeLimits(model_name, min(max_tokens, self.context - 1), self.context, self.runner.vocab_size, tuple(self.eos_token_ids))

    def close(self) -> None:
        self.runner.close()


def completion(r: Request) -> Completion:
    ttft = (r.first_token_at or r.finished_at) - r.arrival
    return Completion(r.prompt, list(r.output), r.text, r.finish_reason or "abort", ttft, r.finished_at - r.arrival)


def local_model_runner(gen: Generator) -> ModelRunner | None:
    """Job rank 0's own model runner under tensor parallelism or on one process (its DistributedRunner sends each step
    to the other ranks); None when the model is pipelined or streamed."""
    local = gen.runner.local if isinstance(gen.runner, DistributedRunner) else gen.runner
    return local if type(local) is ModelRunner else None


def verifying_runner(gen: Generator) -> Runner | None:
    """What speculative decoding's `verify` runs on: the model in memory on one process, split by tensor parallelism,
    or pipelined (every checked position's logits come back from the last stage); None when it is streamed."""
    from behemoth.inference.pipeline import PipelineRunner

    local = gen.runner.local if isinstance(gen.runner, DistributedRunner) else gen.runner
    return local if type(local) is ModelRunner or isinstance(local, PipelineRunner) else None


def check_speculative(gen: Generator, what: str) -> None:
    """Speculative decoding verifies in one forward of the whole model: the model in memory (on one process, split by
    tensor parallelism or pipelined), not streamed."""
    if verifying_runner(gen) is None:
        raise BehemothError(
            f"{what} with a {type(gen.runner).__name__}: speculative decoding verifies in one forward of the model in memory",
            f"drop {what.split()[0]}, or serve without --offload",
        )


def ngram_for(gen: Generator, spec: NgramDraft) -> NgramDraft:
    """`--speculative ngram`: prompt-lookup proposals for this generator (one process, or tensor-parallel: the proposals
    are made on job rank 0 from the request's tokens, the other ranks run only the check)."""
    check_speculative(gen, "--speculative ngram")
    return spec


def draft_for(gen: Generator, path: str, tokens: int, rt: Runtime, memory_mb: float) -> DraftModel:
    """The draft model of `path` on this process, with a KV cache of as many blocks as the target's (within `memory_mb`);
    `rt` is this process's own (`one_rank_runtime`): the target may be split over several, the draft is whole here."""
    check_speculative(gen, f"--draft {path}")
    if rt.world_size > 1:
        raise BehemothError(f"--draft {path} given a runtime of {rt.world_size} processes", "load the draft on one_rank_runtime(rt)")
    SpeculativeDecoder.check_tokens(tokens)
    model = load_model(resolve_source(path, []), rt)
    if model.lm.shape.vocab_size != gen.runner.vocab_size:
        raise BehemothError(
            f"the draft {path} has a vocabulary of {model.lm.shape.vocab_size}, the target {gen.runner.vocab_size}",
            "use a draft with the target's tokenizer and vocabulary",
        )
    runner = local_runner(model, CachePolicy(gen.block_size, memory_mb, max_blocks=gen.num_blocks))
    return DraftModel(runner, runner.storage.layout.num_blocks, tokens)


def attach_speculative(gen: Generator, draft: str | NgramDraft | None, tokens: int, rt: Runtime, memory_mb: float) -> None:
    """Speculative decoding for `gen`: n-gram lookup (an NgramDraft) or the draft model in folder `draft` (None: off),
    loaded on `rt`, this process's own runtime (`one_rank_runtime` when the target is split over several)."""
    if isinstance(draft, NgramDraft):
        gen.draft = ngram_for(gen, draft)
    elif draft is not None:
        gen.draft = draft_for(gen, draft, tokens, rt, memory_mb)


def attach_adapters(gen: Generator, folders: dict[str, str]) -> LoRABank:
    """Serve PEFT LoRA folders (name -> folder) unmerged over the generator's model: a request names one (its slot in
    `SamplingParams.adapter`) and rows of different adapters share a batch. Under tensor parallelism the other ranks
    build their banks too (`follow_model(..., adapters=folders)`), and so do the stages of a pipeline."""
    from behemoth.inference.pipeline import PipelineRunner

    runner = local_model_runner(gen)
    pipeline = verifying_runner(gen)
    if runner is None and isinstance(pipeline, PipelineRunner):
        runner = pipeline.local
    if runner is None:
        raise BehemothError(
            f"batched adapters {sorted(folders)} with a {type(gen.runner).__name__}: they run with the model in memory, on one "
            "process, split by --tp or by --pp",
            "serve without --offload, or merge one adapter with --adapter DIR",
        )
    runner.lora = bank_for(runner, folders)
    return runner.lora


def bank_for(runner: ModelRunner, folders: dict[str, str]) -> LoRABank:
    """This rank's part of the batched adapters: the layers of every block it holds (all of them without a pipeline)."""
    from behemoth.parallel.pipeline.partition import StageBlocks

    pipelined = isinstance(runner.blocks, StageBlocks)
    return LoRABank(runner.lm.module, folders, blocks=runner.view.blocks if pipelined else None)


def generator_for(model: LoadedModel, source: Source, cache: CachePolicy = CachePolicy(), *, max_batch: int = 64) -> Generator:
    """The Generator of job rank 0 (the other ranks run `follow_model`)."""
    local = local_runner(model, cache)
    runner: Runner = local
    if model.pipeline is not None:
        from behemoth.inference.pipeline import PipelineRunner

        runner = PipelineRunner(model, local)
    if model.rt.world_size > 1:
        runner = DistributedRunner(runner, model.rt.world_group)
    return Generator(
        runner,
        num_blocks=local.storage.layout.num_blocks,
        block_size=cache.block_size,
        context=model.lm.shape.context,
        tokenizer=tokenizer_for(model.lm.shape.vocab_size, source.folder),
        eos_token_ids=source.eos_token_ids,
        max_batch=max_batch,
    )


def follow_model(model: LoadedModel, cache: CachePolicy, *, adapters: dict[str, str] | None = None) -> int:
    """The other ranks of a sharded model: run every step rank 0 sends until it stops (with the batched `adapters` rank 0
    serves: each rank its part of every one)."""
    local = local_runner(model, cache)
    if adapters:
        local.lora = bank_for(local, adapters)
    if model.pipeline is not None:
        from behemoth.inference.pipeline import PipelineRunner

        return follow(PipelineRunner(model, local), model.rt.world_group)
    return follow(local, model.rt.world_group)


def load(
    path: str | Source,
    *,
    overrides: list[str] = (),
    cache: CachePolicy = CachePolicy(),
    max_batch: int = 64,
    quantize: str | None = None,
    offload: OffloadPolicy | None = None,
    draft: str | NgramDraft | None = None,
    draft_tokens: int = 4,
) -> Generator:
    """A Generator for a checkpoint, an HF folder or a `Source` (a config alone: weights drawn from its seed), in this
    process; with `offload` (`offload.generation_policy`), its blocks streamed from host memory or disk; with `draft` (a
    folder of a model with the same vocabulary, or an NgramDraft), speculative decoding of `draft_tokens` per step."""
    source = path if isinstance(path, Source) else resolve_source(path, list(overrides))
    rt = init_runtime(timeout_s=source.config.run.timeout_s)
    gen = generator_for(load_for_generation(source, rt, quantize=quantize, offload=offload), source, cache, max_batch=max_batch)
    attach_speculative(gen, draft, draft_tokens, rt, cache.memory_mb)
    return gen


@dataclass
class Offloaded:
    """A single-process Generator over an offloaded model, and the model: its block tier's measures and bytes."""

    generator: Generator
    model: StreamedModel

    @property
    def streamed_bytes(self) -> int:
        return self.model.streamed_bytes

    @property
    def stats(self) -> MeasuredTier:
        return self.model.blocks

    def close(self) -> None:
        self.generator.close()  # its runner stops the model's I/O threads and removes the blocks' files


def offloaded_generator(source: Source, policy: OffloadPolicy, cache: CachePolicy = CachePolicy(), *, rt: Runtime | None = None) -> Offloaded:
    """A single-process Generator whose blocks stream from `policy.params` (`offload.generation_policy`); the resident
    parts and the KV cache on the runtime's device."""
    rt = rt or init_runtime(timeout_s=source.config.run.timeout_s)
    model = load_offloaded(source, rt, policy)
    return Offloaded(generator_for(model, source, cache), model)


def load_for_generation(
    source: Source,
    rt: Runtime,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    quantize: str | None = None,
    offload: OffloadPolicy | None = None,
    expert_layout: str = "owned",
    tp_mode: str = "1d",
) -> LoadedModel:
    """This rank's model: laid out in memory (`ep` > 1: this rank's experts of every MoE layer; `tp_mode` 2d: on a grid),
    or (`offload`) with its blocks on a tier, each tp rank its own shard."""
    if offload is None:
        return load_model(source, rt, tp=tp, pp=pp, ep=ep, quantize=quantize, expert_layout=expert_layout, tp_mode=tp_mode)
    if pp > 1 or ep > 1 or quantize is not None:
        raise BehemothError(
            f"offloaded generation with pp={pp}, ep={ep}, quantize={quantize}: every rank streams all of its blocks, in float32",
            "drop --pp, --ep and --quantize (split each block over ranks with --tp)",
        )
    return load_offloaded(source, rt, offload, tp=tp)


def generate_on_ranks(
    path: str,
    overrides: list[str],
    prompts: list[Any],
    params: list[dict[str, Any]],
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    cache: CachePolicy = CachePolicy(),
    ignore_eos: bool = False,
    quantize: str | None = None,
    offload: OffloadPolicy | None = None,
    rt: Runtime | None = None,
    draft: str | NgramDraft | None = None,
    draft_tokens: int = 4,
    expert_layout: str = "owned",
    tp_mode: str = "1d",
) -> list[Completion] | None:
    """One rank of a tp x pp x ep generation job: rank 0 generates and returns the completions, the others follow
    (None); under ep every rank runs the same steps, each MoE layer's experts computed in `expert_layout`. With
    `offload`, every rank streams its tensor-parallel shard of each block from the policy's tier; with `draft` (one
    process), speculative decoding (`attach_speculative`)."""
    source = resolve_source(path, list(overrides))
    rt = rt or init_runtime(timeout_s=source.config.run.timeout_s, tp=tp, pp=pp, ep=ep)
    draft_rt = one_rank_runtime(rt, source.config.run.timeout_s) if isinstance(draft, str) else rt  # every rank: a collective
    model = load_for_generation(source, rt, tp=tp, pp=pp, ep=ep, quantize=quantize, offload=offload, expert_layout=expert_layout, tp_mode=tp_mode)
    try:
        return _generate_loaded(model, source, prompts, params, cache, ignore_eos, (draft, draft_tokens, draft_rt))
    finally:
        model.close()


def _generate_loaded(
    model: LoadedModel,
    source: Source,
    prompts: list[Any],
    params: list[dict[str, Any]],
    cache: CachePolicy,
    ignore_eos: bool,
    speculative: tuple[str | NgramDraft | None, int, Runtime | None] = (None, 4, None),
) -> list[Completion] | None:
    """Rank 0 generates for the prompts (its cache sized for them), the others follow its steps."""
    rt = model.rt
    sampling = [SamplingParams.model_validate(p) for p in params]
    vocab = model.lm.shape.vocab_size
    tokenizer = tokenizer_for(vocab, source.folder) if any(isinstance(p, (str, dict)) for p in prompts) else None
    lengths = [len(encode_prompt(p, tokenizer, vocab)) for p in prompts]  # on every rank: their caches must agree
    cache = cache.for_batch(lengths, [sp.max_tokens for sp in sampling])
    if rt.rank != 0:
        follow_model(model, cache)
        return None
    gen = generator_for(model, source, cache)
    try:
        attach_speculative(gen, speculative[0], speculative[1], speculative[2] or rt, cache.memory_mb)
        out = gen.generate(prompts, sampling, ignore_eos=ignore_eos)
        if "draft_tokens" in gen.stats:
            print(speculation_line(gen.stats), file=sys.stderr, flush=True)
        return out
    finally:
        gen.close()


def speculation_line(stats: dict[str, int]) -> str:
    """One line of a speculative run's counters: tokens proposed, accepted, their ratio."""
    rate = stats["accepted_tokens"] / stats["draft_tokens"] if stats["draft_tokens"] else 0.0
    return f"behemoth: speculative decoding: {stats['accepted_tokens']} of {stats['draft_tokens']} proposed tokens accepted ({rate:.2f})"


@torch.no_grad()
def reference_logits(model: ParallelModel, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of a full, uncached forward (what cached decoding must equal)."""
    return model.lm.logits(torch.tensor([tokens], device=model.rt.device))[0, -1].float()
