"""`behemoth generate` and `behemoth serve`: generation from any checkpoint or HF folder, and the completions server."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from behemoth.errors import ERROR_PREFIX, BehemothError, Problem, Refused, exit_code

EXAMPLES_GENERATE = """examples:
  behemoth generate runs/20261130-075637 --prompt "def main(" --max-tokens 64
  behemoth generate runs/X --prompt "import " --prompt "class " --temperature 0.8 --top-p 0.9 --seed 1
  behemoth generate path/to/save_pretrained_dir --prompt-ids 1,2,3 --json
  behemoth generate runs/my-chat-finetune --chat "What is 12 plus 30?" --system "be brief"  # the chat template's rendering
  behemoth generate runs/X --nproc 2 --tp 2 --prompt "def "         # tensor-parallel: KV cache split by heads
  behemoth generate runs/X --nproc 2 --pp 2 --prompt "a" --prompt "b" # pipeline: micro-batches of requests
  behemoth generate moe_run --nproc 2 --ep 2 --prompt "def "         # expert-parallel: half of every MoE layer's experts each
  behemoth generate runs/X --offload disk --prompt "def "            # weights streamed layer by layer
  behemoth generate runs/X --offload disk --nproc 2 --tp 2 --prompt "def "  # each rank streams its shard of every block
  behemoth generate runs/X --quantize int8 --prompt "def "           # int8 weight-only
  behemoth generate runs/X --speculative ngram --prompt "..."        # prompt lookup: proposals from the text itself
  behemoth generate runs/X --nproc 2 --tp 2 --speculative ngram --prompt "..."  # the same, each rank checking with its heads
  behemoth generate big_model --draft small_model --prompt "def "     # speculative decoding with a draft model
"""


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options shared by generate and serve: the source, its layout, the KV cache."""
    p.add_argument("source", help="a run directory (its latest checkpoint), a checkpoint folder or a save_pretrained folder")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="processes (default: tp x pp)")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel degree (heads and KV cache split over T)")
    p.add_argument(
        "--tp-mode",
        choices=["1d", "2d"],
        default="1d",
        help="1d (default: heads split over --tp) or 2d (--tp = q*q ranks as a q x q grid: every weight 1/q^2 per process, "
        "the KV cache split by heads over the q columns; Llama, Mistral, Qwen2, Qwen3, Gemma and behemoth's GPT)",
    )
    p.add_argument("--pp", type=int, default=1, metavar="P", help="pipeline-parallel degree (layers over P stages)")
    p.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="E",
        help="expert-parallel degree (MoE models): each process holds 1/E of every MoE layer's experts",
    )
    p.add_argument(
        "--expert-layout",
        choices=["owned", "alltoall", "gather"],
        default="owned",
        help="--ep: owned (default: each process runs its experts on their rows of the batch every process holds, outputs "
        "all-gathered), alltoall (rows to the experts' processes and back) or gather (the experts to every process)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV-cache memory per process in MiB (default 256)")
    p.add_argument(
        "--split-products",
        action="store_true",
        help="a plain Llama's batch-1 decode steps run each matrix product as two halves on two threads (CPU BLAS runs a "
        "one-token product on one; docs/serving.md)",
    )
    p.add_argument(
        "--no-decode-lanes",
        action="store_true",
        help="a plain Llama's decode steps gather each request's cached keys and values from the blocks at every step, "
        "instead of attending to dense per-request lanes kept beside the cache (up to the cache's size again; docs/serving.md)",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="DIR|NAME=DIR",
        help="a PEFT LoRA folder merged into the model's weights (finetune.adapter=DIR); serve: NAME=DIR (repeatable) serves "
        "adapters unmerged, batched together, each request choosing one by its model field",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, e.g. run.timeout_s=600")


def add_speculative_options(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (generate and serve): a draft model, or n-gram lookup in the request's own tokens."""
    p.add_argument(
        "--draft",
        metavar="MODEL_DIR",
        default=None,
        help="speculative decoding: a small model with the same vocabulary proposes tokens the served model checks in one forward",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="ngram: speculative decoding without a draft model, proposing the tokens that followed the last n tokens earlier in "
        "the prompt or output (prompt lookup)",
    )
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K", help="tokens proposed per step (default 4)")
    p.add_argument("--ngram-max", type=int, default=3, metavar="N", help="--speculative ngram: longest suffix looked up (default 3)")
    p.add_argument("--ngram-min", type=int, default=1, metavar="N", help="--speculative ngram: shortest suffix looked up (default 1)")


def speculative_of(args: argparse.Namespace) -> Any:
    """What --draft / --speculative ask for (a folder, an NgramDraft, or None), refused before anything loads when it
    cannot run: the model in memory (on one process or split by --tp/--pp/--ep; a draft model is whole on job rank 0), one
    kind of proposal, at least one token, a draft that exists."""
    from pathlib import Path

    from behemoth.inference.ngram import NgramDraft

    what = "--draft" if args.draft else "--speculative ngram" if args.speculative else None
    if what is None:
        return None
    if args.draft and args.speculative:
        raise BehemothError(f"--draft {args.draft} with --speculative {args.speculative}: one kind of proposal at a time", "drop one of them")
    if getattr(args, "offload", None):
        why = f"--offload {args.offload}"
        raise BehemothError(
            f"{what} with {why}: speculative decoding checks the proposals in one forward of the model in memory, on one process "
            "or split by --tp/--pp/--ep",
            f"drop {what}, or {why}",
        )
    if args.draft_tokens < 1:
        raise BehemothError(
            f"--draft-tokens {args.draft_tokens}: a draft proposes at least one token per step", "use --draft-tokens 1 or more (e.g. 4)"
        )
    if args.speculative:
        return NgramDraft(args.draft_tokens, args.ngram_max, args.ngram_min)
    if not Path(args.draft).exists():
        raise BehemothError(f"--draft {args.draft} does not exist", "give a checkpoint, run directory or save_pretrained folder")
    return args.draft


def with_adapter(args: argparse.Namespace) -> argparse.Namespace:
    """--adapter DIR as the finetune.adapter=DIR option every loading path reads; NAME=DIR ones in args.batched_adapters."""
    merged = [a for a in args.adapter if "=" not in a]
    args.batched_adapters = dict(a.split("=", 1) for a in args.adapter if "=" in a)
    if len(merged) > 1:
        raise BehemothError(f"--adapter {merged[0]} and --adapter {merged[1]}: one adapter is merged at most", "name the others: --adapter NAME=DIR")
    if args.adapter and getattr(args, "offload", None):
        raise BehemothError("--adapter with --offload: streamed weights take no adapter", "drop --offload, or use behemoth export --merge")
    args.adapter = merged[0] if merged else None
    if args.adapter:
        args.overrides = [*args.overrides, f"finetune.adapter={args.adapter}"]
    return args


def without_batched_adapters(args: argparse.Namespace) -> argparse.Namespace:
    """generate merges one adapter: NAME=DIR (a server's batched adapters) has no request to choose it."""
    if args.batched_adapters:
        name = next(iter(args.batched_adapters))
        raise BehemothError(f"--adapter {name}=...: generate has no requests that choose an adapter", "give --adapter DIR to merge one")
    return args


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth generate",
        epilog=EXAMPLES_GENERATE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate text from a checkpoint saved under any layout, or from a Hugging Face folder, "
        "with a paged KV cache; several prompts are batched.",
    )
    add_model_options(p)
    add_speculative_options(p)
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="I,J,K", help="a prompt as comma-separated token ids")
    p.add_argument(
        "--chat",
        action="append",
        default=[],
        metavar="TEXT",
        help="a user message, rendered with the model's chat template and the assistant's turn opened (repeat for a batch)",
    )
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message put before every --chat message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; otherwise sample at this temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens with probability >= p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="penalize tokens already seen (1: off)")
    p.add_argument("--stop", action="append", default=[], help="a string that ends the generation (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="random seed: prompt i samples with seed + i")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
    p.add_argument(
        "--offload",
        choices=["cpu", "host", "disk"],
        default=None,  # a tier of parallel/zero/tiers.py (cpu and host: host memory)
        help="stream weights layer by layer from host memory (cpu or host) or disk (offload.prefetch=N units read ahead, default 1)",
    )
    p.add_argument("--offload-dir", default=None, help="folder for --offload disk (default: a temporary folder)")
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="weight-only quantization: int8 (a scale per channel) or int4 (a scale per 64 inputs)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: tokens, text, finish reason, timings")
    return p


def sampling_dicts(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    one = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.seed,
    )
    from behemoth.inference.sampling import SamplingParams

    try:
        SamplingParams.model_validate(one)
    except Exception as err:  # pydantic's ValidationError, as one line
        first = getattr(err, "errors", lambda: [{"loc": ("?",), "msg": str(err)}])()[0]
        raise BehemothError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}", "see behemoth generate --help") from None
    return [{**one, "seed": None if args.seed is None else args.seed + i} for i in range(n)]


def prompts_of(args: argparse.Namespace) -> list[Any]:
    prompts: list[Any] = list(args.prompt)
    for text in args.prompt_ids:
        try:
            prompts.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise BehemothError(f"--prompt-ids {text!r} is not a comma-separated list of integers", "write e.g. --prompt-ids 1,2,3") from None
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if system and not args.chat:
        raise BehemothError("--system without --chat: a system message belongs to a conversation", "add --chat TEXT")
    prompts += [{"messages": [*system, {"role": "user", "content": text}]} for text in args.chat]
    if not prompts:
        raise BehemothError("no prompt given", "pass --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3")
    return prompts


def generate_here(
    source: str,
    overrides: list[str],
    prompts: list[Any],
    params: list[dict[str, Any]],
    tp: int,
    pp: int,
    block_size: int,
    memory_mb: float,
    ignore_eos: bool,
    quantize: str | None,
    offload: Any = None,
    speculative: tuple[Any, int] = (None, 4),
    experts: tuple[int, str] = (1, "owned"),
    split_products: bool = False,
    tp_mode: str = "1d",
    decode_lanes: bool = True,
) -> Any:
    """One process of a sharded (or offloaded: `offload` an OffloadPolicy) generation; `speculative`: (a draft
    folder or NgramDraft, tokens per step); `experts`: (ep, expert layout); `split_products`, `decode_lanes`: CachePolicy's;
    `tp_mode` 2d: the tp ranks as a grid."""
    from behemoth.inference.generate import CachePolicy, generate_on_ranks

    return generate_on_ranks(
        source,
        overrides,
        prompts,
        params,
        tp=tp,
        pp=pp,
        ep=experts[0],
        expert_layout=experts[1],
        cache=CachePolicy(block_size, memory_mb, split_products=split_products, decode_lanes=decode_lanes),
        ignore_eos=ignore_eos,
        quantize=quantize,
        offload=offload,
        draft=speculative[0],
        draft_tokens=speculative[1],
        tp_mode=tp_mode,
    )


def worker(*args: Any) -> Any:
    """`generate_here` in a launched process: a refusal printed here too (the launcher reports only that it failed)."""
    try:
        return generate_here(*args)
    except BehemothError as err:
        print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
        raise


def world_size(args: argparse.Namespace) -> int:
    degrees = args.tp * args.pp * args.ep
    nproc = args.nproc if args.nproc is not None else degrees
    if nproc != degrees:
        named = f"--tp {args.tp} x --pp {args.pp}" + (f" x --ep {args.ep}" if args.ep != 1 else "")
        raise BehemothError(f"--nproc {nproc} but {named} = {degrees}", "set --nproc to tp x pp" + (" x ep" if args.ep != 1 else ""))
    return nproc


def check_expert_parallel(args: argparse.Namespace) -> None:
    """--ep before anything loads: each rank runs every request through every layer, its own experts of the MoE layers;
    a pipeline (whose stages hold different layers) and offload (which streams whole blocks) take no ep."""
    if args.ep < 1:
        raise BehemothError(f"--ep {args.ep} is not a positive degree", "use --ep 1 or more")
    other = f"--pp {args.pp}" if args.pp > 1 else f"--offload {args.offload}" if getattr(args, "offload", None) else None
    if args.ep > 1 and other:
        raise BehemothError(
            f"--ep {args.ep} with {other}: expert-parallel generation replicates the other layers on every rank, in memory",
            f"drop {other} (--ep composes with --tp)",
        )


def check_grid(args: argparse.Namespace) -> None:
    """--tp-mode 2d before anything loads: the options a grid's generation does not run with yet."""
    from behemoth.inference.loading import grid_generation_problems

    found = grid_generation_problems(
        args.tp_mode,
        pp=args.pp,
        ep=args.ep,
        quantize=args.quantize,
        offload=bool(getattr(args, "offload", None)),
        adapter=bool(args.adapter or getattr(args, "batched_adapters", None)),
    )
    if found:
        raise BehemothError("; ".join(found), "drop those options, or run --tp-mode 1d (a 2-D checkpoint loads in any layout)")


def check_plan(args: argparse.Namespace, nproc: int) -> None:
    """Refuse, before any process starts, a source that does not load or degrees the model cannot be split by."""
    from behemoth.inference.generate import CachePolicy
    from behemoth.inference.loading import check_inference_plan, inference_config, resolve_source

    CachePolicy(args.block_size, args.kv_cache_mb)
    check_expert_parallel(args)
    check_grid(args)
    source = resolve_source(args.source, args.overrides)
    try:
        check_inference_plan(inference_config(source.config, tp=args.tp, pp=args.pp, ep=args.ep, tp_mode=args.tp_mode), nproc)
    except Refused as err:  # in the words of this command's options
        words = {"parallel.tp_mode=": "--tp-mode ", "parallel.tp ": "--tp ", "parallel.tp=": "--tp "}
        words.update({"parallel.pp=": "--pp ", "parallel.ep=": "--ep "})
        raise Refused(Problem(p.option, _in_words(p.message, words)) for p in err.problems) from None


def _in_words(message: str, words: dict[str, str]) -> str:
    for key, word in words.items():
        message = message.replace(key, word)
    return message


def run_generate(args: argparse.Namespace) -> int:
    from behemoth.faults.launch import launch

    prompts, nproc = prompts_of(args), world_size(args)
    params = sampling_dicts(args, len(prompts))
    check_plan(args, nproc)
    speculative = (speculative_of(args), args.draft_tokens)
    with offload_policy(args) as offload:
        call = (args.source, args.overrides, prompts, params, args.tp, args.pp, args.block_size, args.kv_cache_mb, args.ignore_eos, args.quantize)
        experts = (args.ep, args.expert_layout)
        rest = (offload, speculative, experts, args.split_products, args.tp_mode, not args.no_decode_lanes)
        out = generate_here(*call, *rest) if nproc == 1 else launch(nproc, worker, *call, *rest)[0]
    return print_completions(out, args.json)


@contextlib.contextmanager
def offload_policy(args: argparse.Namespace) -> Iterator[Any]:
    """The OffloadPolicy --offload asks for (None without it), refused before launch if it cannot run; --offload disk
    writes the blocks under --offload-dir or a temporary folder, removed afterwards."""
    if not args.offload:
        yield None
        return
    import shutil
    import tempfile

    from behemoth.inference.loading import resolve_source
    from behemoth.inference.offload import generation_policy

    if args.pp > 1 or args.quantize:
        raise BehemothError(
            f"--offload with --pp {args.pp}{' and --quantize ' + args.quantize if args.quantize else ''}: every rank streams all of its "
            "blocks, in float32",
            "drop --pp and --quantize (split each block over ranks with --nproc N --tp N)",
        )
    offload = resolve_source(args.source, args.overrides).config.offload
    given = {o.partition("=")[0].removeprefix("offload.") for o in args.overrides if o.startswith("offload.")}
    streams = {k: getattr(offload, k) for k in ("prefetch", "io_threads") if k in given}  # else one unit ahead, one thread
    folder = args.offload_dir or (tempfile.mkdtemp(prefix="behemoth-offload-") if args.offload == "disk" else None)
    try:
        yield generation_policy(args.offload, folder, **streams)
    finally:
        if folder and not args.offload_dir:
            shutil.rmtree(folder, ignore_errors=True)


def print_completions(completions: list[Any], as_json: bool) -> int:
    for c in completions:
        if as_json:
            print(
                json.dumps(
                    {
                        "prompt_tokens": c.prompt_tokens,
                        "tokens": c.tokens,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "time_to_first_token_s": round(c.time_to_first_token_s, 4),
                        "latency_s": round(c.latency_s, 4),
                    }
                )
            )
        else:
            print(c.text if c.text or not c.tokens else " ".join(map(str, c.tokens)))
    return 0


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_intermixed_args(argv)
    return exit_code(lambda a: run_generate(without_batched_adapters(with_adapter(a))), args)
