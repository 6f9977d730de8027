"""`behemoth serve`: the OpenAI-compatible completions server over any checkpoint or HF folder."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING, Any, Literal

from behemoth.cli.generate import add_model_options, add_speculative_options, check_plan, speculative_of, with_adapter, world_size
from behemoth.errors import ERROR_PREFIX, BehemothError, exit_code

if TYPE_CHECKING:  # the serving stack is imported when the server starts
    from behemoth.inference.generate import Generator
    from behemoth.inference.scheduler import SchedulerPolicy
    from behemoth.inference.server import ServeLimits
    from behemoth.inference.serving import EngineLoop

EXAMPLES = """examples:
  behemoth serve runs/20261130-075637 --port 8000
  curl localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'
  curl -N localhost:8000/v1/completions -d '{"prompt": "import ", "max_tokens": 64, "stream": true}'
  curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}'
  behemoth serve path/to/hf_folder --api-key "$KEY"   # every /v1/ request needs "Authorization: Bearer $KEY"
  behemoth serve runs/X --nproc 2 --tp 2          # tensor-parallel: each process holds half of every layer and of the KV cache
  behemoth serve runs/X --nproc 2 --ep 2          # expert-parallel (MoE): each process holds half of every layer's experts
  behemoth serve path/to/save_pretrained_dir --max-batch 64 --kv-cache-mb 2048
  behemoth serve big_model --draft small_model --draft-tokens 4   # speculative decoding (same vocabulary)
  behemoth serve runs/X --speculative ngram                        # speculative decoding by prompt lookup (no draft model)
  behemoth serve runs/X --prefill-chunk 256                        # long prompts prefilled 256 tokens per step
  behemoth serve runs/X --prefill-chunk auto                       # chunk measured at start: a step within 1.5x of a decode step
  behemoth serve hf_dir --nproc 2 --tp 2 --adapter sql=lora_dir     # batched LoRA adapters, split like the layers they adapt
  behemoth serve runs/X --nproc 2 --tp 2 --kv-offload --speculative ngram   # KV offload and prompt lookup under --tp
"""


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth serve",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over HTTP: OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models "
        "(streaming or not), /health, /metrics (docs/serving.md); continuous batching over a paged KV cache, 429 when the queue is full.",
    )
    add_model_options(p)
    add_speculative_options(p)
    add_limit_options(p)
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="share the KV blocks of equal prompt prefixes between requests (a shared system prompt is prefilled once)",
    )
    p.add_argument(
        "--prefill-chunk",
        default=None,
        metavar="N|auto",
        help="prefill at most N prompt tokens per step, in the same forward as the running requests' decodes (a long prompt does "
        "not stall running streams; default: whole prompts). auto: step times measured at start on the served model pick, at "
        "every step, the largest chunk whose step stays within --prefill-step-factor x a decode-only step of the running batch",
    )
    p.add_argument(
        "--prefill-step-factor",
        type=float,
        default=None,
        metavar="F",
        help="with --prefill-chunk auto: how much longer than a decode-only step a step that also prefills may take (default 1.5)",
    )
    p.add_argument(
        "--kv-offload",
        action="store_true",
        help="a preempted request's KV blocks go to host memory and come back when it resumes (instead of its recomputation); "
        "under --tp/--pp each process keeps its own heads and layers, under --ep its copy of them",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="weight-only quantization: int8 (a scale per channel) or int4 (a scale per 64 inputs)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/ (default: none; also read from BEHEMOTH_API_KEY); 401 without it",
    )
    p.add_argument(
        "--batching",
        choices=["continuous", "static"],
        default="continuous",
        help="continuous (default): requests join and leave at every step; static: a batch runs until all of it ends",
    )
    return p


def add_limit_options(p: argparse.ArgumentParser) -> None:
    """Where the server listens, what it calls the model, and the limits that keep a client from holding it."""
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None, help="the model's name in the API (default: the source folder's name)")
    p.add_argument("--max-batch", type=int, default=32, help="requests decoded together at most (default 32)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued at most; more get 429 (default 256)")
    p.add_argument("--max-tokens", type=int, default=1024, help="largest max_tokens a request may ask (default 1024)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt a request may send (default: the context)")
    p.add_argument("--max-streams", type=int, default=64, help="streamed responses open at once; one more gets 429 (default 64)")
    p.add_argument("--max-choices", type=int, default=16, help="generations one request may ask (n x best_of x prompts; default 16)")
    p.add_argument("--max-body-kb", type=int, default=1024, help="largest request body in KiB; a larger one gets 413 (default 1024)")
    p.add_argument("--body-timeout-s", type=float, default=30.0, help="a request body slower than this between pieces gets 408 (default 30)")
    p.add_argument(
        "--step-timeout-s",
        type=float,
        default=120.0,
        help="with several processes: an engine step (its collectives with the other ranks) running longer fails the server: "
        "/health 503, requests 503, exit non-zero (default 120)",
    )
    p.add_argument(
        "--stream-idle-timeout-s",
        type=float,
        default=30.0,
        help="a stream whose client takes none of its waiting bytes for this long is cancelled and its KV blocks freed (default 30)",
    )
    p.add_argument(
        "--stream-max-unsent-kb",
        type=int,
        default=256,
        help="a stream with more KiB written that its client has not taken is cancelled and its KV blocks freed (default 256)",
    )


def policy_of(args: argparse.Namespace, context: int) -> SchedulerPolicy:
    """The scheduler's limits from the command line (each a positive count)."""
    from behemoth.inference.scheduler import SchedulerPolicy

    for name in ("body_timeout_s", "step_timeout_s", "stream_idle_timeout_s"):
        if not getattr(args, name) > 0:
            raise BehemothError(f"--{name.replace('_', '-')} {getattr(args, name)} is not a positive number of seconds", "use e.g. 30")
    counts = ("max_batch", "max_waiting", "max_tokens", "max_streams", "max_choices", "max_body_kb", "max_prompt_tokens")
    for name in (*counts, "stream_max_unsent_kb"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BehemothError(f"--{name.replace('_', '-')} {getattr(args, name)} is not a positive count", "use 1 or more")
    chunk = prefill_chunk_of(args)
    return SchedulerPolicy(
        max_batch=args.max_batch,
        max_waiting=args.max_waiting,
        context=context,
        policy=args.batching,
        prefix_caching=args.prefix_caching,
        prefill_chunk=chunk,
        step_factor=1.5 if args.prefill_step_factor is None else args.prefill_step_factor,
        kv_offload=args.kv_offload,
    )


def prefill_chunk_of(args: argparse.Namespace) -> int | Literal["auto"] | None:
    """--prefill-chunk: a positive count, or auto where its measured budget can run (one forward for a chunk and the
    decodes: no draft model, no pipeline); --prefill-step-factor only with auto."""
    text = args.prefill_chunk
    if args.prefill_step_factor is not None and text != "auto":
        raise BehemothError(f"--prefill-step-factor {args.prefill_step_factor} without --prefill-chunk auto", "add --prefill-chunk auto")
    if text is None:
        return None
    if text == "auto":
        other = "--draft" if args.draft else "--speculative" if args.speculative else f"--pp {args.pp}" if args.pp > 1 else None
        if other:
            raise BehemothError(f"--prefill-chunk auto with {other}: its prompt chunks and decodes cannot share one forward", "use --prefill-chunk N")
        return "auto"
    try:
        chunk = int(text)
    except ValueError:
        raise BehemothError(f"--prefill-chunk {text} is neither a count of tokens nor auto", "use e.g. --prefill-chunk 256, or auto") from None
    if chunk < 1:
        raise BehemothError(f"--prefill-chunk {chunk} is not a positive count", "use 1 or more")
    return chunk


def check_batched_adapters(args: argparse.Namespace, nproc: int) -> None:
    """--adapter NAME=DIR before anything loads: one process, --tp or --pp (no experts split), no prefix caching
    (its blocks are named by tokens alone), no quantization, distinct names that exist as folders."""
    from pathlib import Path

    for name, folder in args.batched_adapters.items():
        if args.ep > 1:
            raise BehemothError(
                f"--adapter {name}={folder} with --ep {args.ep}: batched adapters run on one process or split by --tp or --pp",
                f"drop --ep {args.ep}",
            )
        if args.prefix_caching or args.quantize:
            what = "--prefix-caching" if args.prefix_caching else f"--quantize {args.quantize}"
            raise BehemothError(f"--adapter {name}={folder} with {what}: batched adapters run without it", f"drop {what}")
        if not name or not Path(folder).is_dir():
            raise BehemothError(f"--adapter {name}={folder}: not a NAME=DIR of an adapter folder", "give e.g. --adapter support=path/to/lora")


def serve_limits(args: argparse.Namespace, base: ServeLimits) -> ServeLimits:
    """The model's limits with the command line's: prompt length, streams, choices, body size, API key, adapter names."""
    import os
    from dataclasses import replace
    from pathlib import Path

    return replace(
        base,
        max_prompt_tokens=args.max_prompt_tokens,
        max_streams=args.max_streams,
        max_choices=args.max_choices,
        max_body_bytes=args.max_body_kb * 1024,
        body_timeout_s=args.body_timeout_s,
        stream_idle_timeout_s=args.stream_idle_timeout_s,
        stream_max_unsent_bytes=args.stream_max_unsent_kb * 1024,
        api_key=args.api_key or os.environ.get("BEHEMOTH_API_KEY") or None,
        adapters=(Path(args.adapter).resolve().name,) if args.adapter else (),
        batched_adapters=tuple(args.batched_adapters),
    )


def serve_on_ranks(args: argparse.Namespace) -> None:
    """One process of the server: rank 0 runs HTTP and the scheduler, the others run the steps it sends."""
    from pathlib import Path

    from behemoth.inference.generate import CachePolicy, follow_model, generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime, one_rank_runtime

    source = resolve_source(args.source, args.overrides)
    rt = init_runtime(timeout_s=source.config.run.timeout_s, tp=args.tp, pp=args.pp, ep=args.ep)
    draft_rt = one_rank_runtime(rt, source.config.run.timeout_s) if args.draft else rt  # every rank: a collective
    model = load_model(source, rt, tp=args.tp, pp=args.pp, ep=args.ep, quantize=args.quantize, expert_layout=args.expert_layout, tp_mode=args.tp_mode)
    cache = CachePolicy(args.block_size, args.kv_cache_mb, split_products=args.split_products, decode_lanes=not args.no_decode_lanes)
    if rt.world_size > 1:  # heartbeats: a hung step's diagnosis names the rank that never arrived
        from behemoth.flight import RECORDER

        RECORDER.arm(run_dir=None, timeout_s=source.config.run.timeout_s)
    if rt.rank != 0:
        follow_model(model, cache, adapters=args.batched_adapters)
        return
    gen = generator_for(model, source, cache, max_batch=args.max_batch)
    if args.draft or args.speculative:
        from behemoth.inference.generate import attach_speculative

        attach_speculative(gen, speculative_of(args), args.draft_tokens, draft_rt, args.kv_cache_mb)
    if args.batched_adapters:
        from behemoth.inference.generate import attach_adapters

        attach_adapters(gen, args.batched_adapters)
    engine = gen.engine(policy_of(args, gen.context))
    limits = serve_limits(args, gen.limits(args.model_name or Path(args.source).resolve().name, args.max_tokens))
    serve_engine(args, engine, limits, gen, several_ranks=rt.world_size > 1)


def serve_engine(args: argparse.Namespace, engine: EngineLoop, limits: ServeLimits, gen: Generator, *, several_ranks: bool) -> None:
    """Rank 0: HTTP until a signal or a failed engine. A failed engine (a step raised, or outlived --step-timeout-s)
    answers 503 for two seconds, then the server stops and this raises (exit code non-zero: a supervisor restarts it).
    A signal makes /health answer 503 for a second before the server stops; with several ranks it fails the engine
    (the launcher signals rank 0 when another worker failed: its steps cannot finish)."""
    from behemoth.inference.app import build_app, uvicorn_server
    from behemoth.inference.liveness import EngineWatchdog

    def on_signal(name: str) -> None:
        if several_ranks:
            engine.fail(f"stopped by {name}: the launcher stops every worker when one of them fails or the server is interrupted")
        else:
            engine.closing = f"stopped by {name}"

    server = uvicorn_server(build_app(engine, limits, gen.tokenizer), args.host, args.port, on_signal=on_signal)
    step_timeout_s = args.step_timeout_s if several_ranks else None  # one process: a long step (disk offload) is no hang
    watchdog = EngineWatchdog(engine, step_timeout_s, on_failed=lambda: setattr(server, "should_exit", True))
    if several_ranks:  # one process: the engine steps on this thread (serve_beside_engine)
        engine.start()
    watchdog.start()
    if args.host not in ("127.0.0.1", "localhost", "::1") and not limits.api_key:
        print(f"behemoth: warning: listening on {args.host} with no --api-key: anyone who reaches this port can use the model", file=sys.stderr)
    print(
        f"behemoth: serving {limits.model_name} ({gen.num_blocks} KV blocks of {gen.block_size} tokens, {args.batching} batching) "
        f"on http://{args.host}:{args.port}/v1 (completions, chat/completions, models){'; API key required' if limits.api_key else ''}",
        flush=True,
    )
    if engine.scheduler.budget is not None:
        print(f"behemoth: {engine.scheduler.budget.describe()}", flush=True)
    try:
        if several_ranks:
            server.run()
        else:
            serve_beside_engine(server, engine)
    finally:
        watchdog.stop()
        engine.stop()
    if engine.error is not None:
        last = engine.error.strip().splitlines()[-1]
        raise BehemothError(f"the serving engine failed, so the server stopped: {last}", "see the log above; start the server again")


def serve_beside_engine(server: Any, engine: EngineLoop) -> None:
    """One process: HTTP on a thread of its own while the engine steps on this (main) thread, the one that loaded the
    model (`EngineLoop.run_here`: its parallel regions ran about 1.5x slower on a second thread). SIGTERM/SIGINT reach
    uvicorn's handler from here (uvicorn installs none off the main thread); the engine stops when the server has."""
    import signal

    failed: list[BaseException] = []

    def http() -> None:
        try:
            server.run()
        except BaseException as err:  # uvicorn exits (SystemExit) when it cannot listen
            failed.append(err)
        finally:
            engine.stopping = True
            engine.wake.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    thread = threading.Thread(target=http, name="behemoth-http", daemon=True)
    thread.start()
    engine.run_here()
    while thread.is_alive():  # a failed engine: the watchdog stops the server; a signal still reaches this thread
        thread.join(timeout=0.5)
    if failed and not server.started:
        raise BehemothError(
            f"the HTTP server did not start ({failed[0].__class__.__name__}: {failed[0]})", "is the port free? pick another with --port"
        )


def serve_worker(args: argparse.Namespace) -> None:
    """One launched server process; its refusal is printed before it propagates to the launcher."""
    try:
        serve_on_ranks(args)
    except BehemothError as err:
        print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
        raise


def run_serve(args: argparse.Namespace) -> int:
    """`behemoth serve`: check the plan, then serve on one process or launch one per rank."""
    from behemoth.faults.launch import launch
    from behemoth.inference.app import require_serving_stack

    require_serving_stack()
    nproc = world_size(args)
    check_plan(args, nproc)
    policy_of(args, 1)
    speculative_of(args)
    check_batched_adapters(args, nproc)
    if nproc == 1:
        serve_on_ranks(args)
        return 0
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        launch(nproc, serve_worker, args, timeout_s=3600)
    except SignalException as err:  # Ctrl-C or a service manager's SIGTERM: the launcher has stopped the workers
        print(f"behemoth: server stopped ({err.sigval.name})", file=sys.stderr)
    return 0


def serve_main(argv: list[str]) -> int:
    return exit_code(lambda a: run_serve(with_adapter(a)), serve_parser().parse_intermixed_args(argv))
