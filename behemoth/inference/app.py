"""The FastAPI application of `behemoth serve`, and running it with uvicorn (in this thread or a background one).

The routes are thin: `server.py` parses and checks requests and turns engine events into OpenAI's
objects; `serving.py` runs the engine. `ServerThread` runs the whole server inside another program
(the tests, the serving benchmark) on a free port.
"""

import threading
import time
from typing import Any

from behemoth.errors import BehemothError
from behemoth.faults.launch import free_port
from behemoth.inference.server import ApiError, Completion, ServeLimits, chunk, collect, parse_request, prompt_tokens, stream
from behemoth.inference.serving import EngineLoop
from behemoth.inference.text import Tokenizer


def require_serving_stack() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise BehemothError("behemoth serve needs FastAPI and uvicorn, which are not installed", "pip install 'behemoth[serve]'") from None


def build_app(engine: EngineLoop, limits: ServeLimits, tokenizer: "Tokenizer | None") -> Any:
    """The ASGI application: /v1/completions, /v1/models, /health, /metrics; every error a JSON body."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="behemoth", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics

    def error(err: ApiError) -> JSONResponse:
        metrics.response(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:  # unknown route, wrong method
        return error(ApiError(exc.status_code, str(exc.detail), code="http_error"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(ApiError(400, str(exc.errors()[0].get("msg", "invalid request")), code="invalid_request"))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:  # a defect, never a bad request
        return error(ApiError(500, f"internal error ({exc.__class__.__name__})", code="internal_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            req = parse_request(await read_body(request, limits.max_body_bytes), limits)
            completion = Completion(
                engine,
                prompt_tokens(req, tokenizer, limits),
                req.sampling().model_copy(update={"stop_token_ids": [] if req.ignore_eos else list(limits.eos_token_ids)}),
            )
        except ApiError as err:
            return error(err)
        metrics.response(200)
        if req.stream:
            return StreamingResponse(stream(completion, limits.model_name), media_type="text/event-stream")
        text, reason = await collect(completion, request.is_disconnected)
        if reason == "error":
            return error(ApiError(503, "the engine failed while generating; see the server log", code="engine_failed"))
        return JSONResponse(chunk(completion.request.id, limits.model_name, text, reason, completion.usage()))

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": limits.model_name, "object": "model", "owned_by": "behemoth", "max_model_len": limits.context}]}

    @app.get("/health")
    async def health() -> Any:
        if engine.healthy:
            return {"status": "ok", **engine.scheduler.gauges()}
        return JSONResponse({"status": "failed", "error": (engine.error or "engine stopped").splitlines()[-1]}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Any:
        return PlainTextResponse(metrics.render(engine.scheduler.gauges(), engine.scheduler.stats), media_type="text/plain; version=0.0.4")

    return app


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, read no further than one byte past `limit` (parse_request refuses it then)."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            break
    return bytes(body)


def uvicorn_server(app: Any, host: str, port: int) -> Any:
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


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
