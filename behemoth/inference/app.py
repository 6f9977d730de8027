"""The FastAPI application of `behemoth serve`, and running it with uvicorn (in this thread or a background one).

The routes are thin: `completions.py` and `chat.py` check their endpoint's fields and turn engine events
into OpenAI's objects, `server.py` holds what they share (limits, errors, requests in flight, stream
slots); `serving.py` runs the engine. With an API key, every /v1/ route needs it (401 otherwise).
`ServerThread` runs the whole server inside another program
(the tests, the serving benchmark) on a free port.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from behemoth.errors import BehemothError
from behemoth.faults.launch import free_port
from behemoth.inference.backpressure import TRANSPORT_KEY, StreamGuard, TransportTap
from behemoth.inference.chat import ChatRequest, chat_prompt, chat_response, start_chat, stream_chat
from behemoth.inference.completions import CompletionRequest, completion_prompts, completion_response, start_completion, stream_completion
from behemoth.inference.server import ApiError, ServeLimits, StreamSlots, collect, parse_body
from behemoth.inference.serving import EngineLoop
from behemoth.inference.text import Tokenizer


def require_serving_stack() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise BehemothError("behemoth serve needs FastAPI and uvicorn, which are not installed", "pip install 'behemoth[serve]'") from None


@dataclass(frozen=True)
class Route:
    """One generation endpoint: its request model, and how a parsed request becomes a prompt, a flight in the engine,
    a stream of chunks or one response object."""

    model: type
    prepare: Callable[[Any], Any]  # request -> its prompt(s)
    start: Callable[[Any, Any], Any]  # (request, prepared) -> the flight of its generations (None: nothing to generate)
    stream: Callable[[Any, Any, Any, Any], Any]  # (request, prepared, flight, stream slot) -> SSE chunks
    respond: Callable[[Any, Any, Any, list], dict]  # (request, prepared, flight, results) -> the response object


def generation_routes(engine: EngineLoop, limits: ServeLimits, tokenizer: "Tokenizer | None") -> dict[str, Route]:
    """/v1/completions and /v1/chat/completions as data (completions.py, chat.py)."""

    def answered(req: Any) -> str:
        """The model a response names: the adapter (or base) the request asked for, else the base."""
        return req.model or limits.model_name

    return {
        "/v1/completions": Route(
            CompletionRequest,
            lambda req: completion_prompts(req, tokenizer, limits),
            lambda req, prompts: start_completion(engine, req, prompts, limits),
            lambda req, prompts, flight, slot: stream_completion(req, prompts, flight, tokenizer, answered(req), slot),
            lambda req, prompts, flight, results: completion_response(req, prompts, flight, results, tokenizer, answered(req)),
        ),
        "/v1/chat/completions": Route(
            ChatRequest,
            lambda req: chat_prompt(req, tokenizer, limits),
            lambda req, prepared: start_chat(engine, req, prepared[0], prepared[1], limits),
            lambda req, prepared, flight, slot: stream_chat(req, prepared[0], flight, tokenizer, answered(req), slot),
            lambda req, prepared, flight, results: chat_response(req, prepared[0], flight, results, tokenizer, answered(req)),
        ),
    }


def add_error_handlers(app: Any, error: Callable[[ApiError], Any]) -> None:
    """Every error a JSON body: unknown routes and methods, invalid bodies, and defects (500, never a bad request)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> Any:
        return error(ApiError(exc.status_code, str(exc.detail), code="http_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> Any:
        return error(ApiError(400, str(exc.errors()[0].get("msg", "invalid request")), code="invalid_request"))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> Any:
        return error(ApiError(500, f"internal error ({exc.__class__.__name__})", code="internal_error"))


def build_app(engine: EngineLoop, limits: ServeLimits, tokenizer: "Tokenizer | None") -> Any:
    """The ASGI application: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; every error a JSON body."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask

    app = FastAPI(title="behemoth", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics
    slots = StreamSlots(limits.max_streams)

    def error(err: ApiError) -> JSONResponse:
        metrics.response(err.status)
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def streamed(request: Request, chunks: Any, flight: Any, slot: Any) -> StreamingResponse:
        """A stream's response, guarded against a client that stops reading (`backpressure.py`)."""
        name = f"of request {flight.requests[0].id}" if flight is not None else "without generations"
        abort = flight.abort if flight is not None else (lambda: None)
        guard = StreamGuard(
            request.scope.get(TRANSPORT_KEY),
            abort,
            name,
            max_unsent_bytes=limits.stream_max_unsent_bytes,
            idle_timeout_s=limits.stream_idle_timeout_s,
        ).start()
        return StreamingResponse(guard.passing(chunks), media_type="text/event-stream", background=BackgroundTask(slot.release))

    async def generate(request: Request, route: Route) -> Any:
        slot = None
        try:
            req = parse_body(await read_body(request, limits.max_body_bytes, limits.body_timeout_s), limits, route.model)
            prepared = route.prepare(req)
            slot = slots.take() if req.stream else None
            flight = route.start(req, prepared)
            if slot is not None:
                metrics.response(200)
                return streamed(request, route.stream(req, prepared, flight, slot), flight, slot)
            results = await collect(flight, request.is_disconnected) if flight is not None else []
        except ApiError as err:
            if slot is not None:
                slot.release()
            return error(err)
        metrics.response(200)
        return JSONResponse(route.respond(req, prepared, flight, results))

    add_error_handlers(app, error)
    if limits.api_key:
        app.add_middleware(ApiKeyGate, key=limits.api_key, refuse=lambda: error(ApiError(401, UNAUTHORIZED, code="invalid_api_key")))

    def endpoint(route: Route) -> Callable[[Request], Any]:
        async def handler(request: Request) -> Any:
            return await generate(request, route)

        return handler

    for path, route in generation_routes(engine, limits, tokenizer).items():
        app.add_api_route(path, endpoint(route), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": model_cards(limits)}

    @app.get("/health")
    async def health() -> Any:
        if engine.healthy:
            return {"status": "ok", **engine.scheduler.gauges(), "streams_open": slots.open}
        if engine.error is None and engine.closing is not None:
            return JSONResponse({"status": "stopping", "error": engine.closing}, status_code=503)
        return JSONResponse({"status": "failed", "error": (engine.error or "engine stopped").strip().splitlines()[-1]}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(metrics.render(engine.scheduler.gauges(), engine.scheduler.stats), media_type="text/plain; version=0.0.4")

    return TransportTap(app)


UNAUTHORIZED = "a valid API key is needed: send the header 'Authorization: Bearer <key>'"


class ApiKeyGate:
    """ASGI middleware: every /v1/ request without the server's key is answered 401 (a plain ASGI layer, so that
    handlers still see their client disconnect)."""

    def __init__(self, app: Any, key: str, refuse: Any) -> None:
        self.app, self.key, self.refuse = app, key, refuse

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not authorized(header, self.key):
                await self.refuse()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def authorized(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries the server's key (compared in constant time)."""
    import hmac

    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def model_cards(limits: ServeLimits) -> list[dict[str, Any]]:
    """The served model, and each adapter merged into it (its `parent`): a request may name any of them."""
    base = {"id": limits.model_name, "object": "model", "created": 0, "owned_by": "behemoth", "max_model_len": limits.context}
    names = limits.adapters + limits.batched_adapters
    return [base] + [{**base, "id": name, "parent": limits.model_name, "root": limits.model_name} for name in names]


async def read_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The request body, read no further than one byte past `limit` (parse_body refuses it then); a client that sends
    it slower than one piece per `timeout_s` seconds is answered 408 (a slow client holds no connection forever)."""
    import asyncio

    body = bytearray()
    pieces = request.stream().__aiter__()
    while True:
        try:
            piece = await asyncio.wait_for(pieces.__anext__(), timeout_s)
        except StopAsyncIteration:
            return bytes(body)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the body did not arrive within {timeout_s:g} s of its last piece", code="request_timeout") from None
        body += piece
        if len(body) > limit:
            return bytes(body)


def uvicorn_server(app: Any, host: str, port: int, on_signal: Any = None, drain_s: float = 1.0) -> Any:
    """uvicorn's server; with `on_signal`, its first SIGTERM/SIGINT calls `on_signal(name)` (the engine then refuses
    new requests, /health answers 503) and the server stops `drain_s` later, so that probes and clients see the 503."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_signal is not None:
        stop_now, draining = server.handle_exit, threading.Event()

        def handle_exit(sig: int, frame: Any) -> None:
            import signal

            if server.should_exit or draining.is_set():  # a second signal stops at once
                stop_now(sig, frame)
                return
            draining.set()
            on_signal(signal.Signals(sig).name)
            threading.Timer(drain_s, stop_now, (sig, frame)).start()

        server.handle_exit = handle_exit  # type: ignore[method-assign]  # uvicorn installs it as the signal handler
    return server


class ServerThread:
    """The server on a background thread of this process (tests, benchmarks): `with ServerThread(...) as url: ...`."""

    def __init__(self, engine: EngineLoop, limits: ServeLimits, tokenizer: "Tokenizer | None", *, host: str = "127.0.0.1") -> None:
        require_serving_stack()
        self.engine, self.port = engine, free_port()
        self.server = uvicorn_server(build_app(engine, limits, tokenizer), host, self.port)
        self.thread = threading.Thread(target=self.server.run, name="behemoth-http", daemon=True)
        self.url = f"http://{host}:{self.port}"

    def __enter__(self) -> str:
        self.engine.start()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on port {self.port}")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()
