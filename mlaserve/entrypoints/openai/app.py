"""The FastAPI application: routes, API key, body-size limit and OpenAI-style error bodies.

Every engine interaction goes through `OpenAIServing` (serving.py) and the engine loop; this
module is HTTP only. /health and /metrics stay open when an API key is set, and so do the web
page's static files (page.py: they hold no data; the page's own calls carry the key).
"""

from __future__ import annotations

import hmac
import json
import logging
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlaserve import __version__
from mlaserve.entrypoints.openai import chat, completions
from mlaserve.entrypoints.openai.constraints import below
from mlaserve.entrypoints.openai.debug_views import (
    checkpoint_config,
    jsonable,
    kernel_rows,
    provenance_rows,
    verify_rows,
)
from mlaserve.entrypoints.openai.errors import APIError, from_pydantic
from mlaserve.entrypoints.openai.page import PUBLIC_PATHS, add_page
from mlaserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeMessages,
    TokenizeRequest,
)
from mlaserve.entrypoints.openai.serving import ClientGone, OpenAIServing

log = logging.getLogger("mlaserve.server")
OPEN_PATHS = ("/health", "/metrics")
MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(
    serving: OpenAIServing,
    api_key: str | None = None,
    ring=None,
    max_body: int = MAX_BODY_BYTES,
    allowed_origins: list[str] | None = None,
    debug_endpoints: bool = False,
    ui: bool = False,
    verify=None,
):
    """debug_endpoints: /debug/routes, /debug/config, /debug/provenance, /debug/kernels, /debug/verify
    and the /docs, /redoc pages (off by default; behind the API key when one is set, as every route but
    /health and /metrics). ui: the web page at / (page.py; its route and configuration views read the
    debug endpoints). verify: `serve --verify`'s checks (verify.Check list; None: not run)."""
    docs = {} if debug_endpoints else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="mlaserve", version=__version__, **docs)
    app.state.serving = serving
    _add_errors(app, serving)
    _add_api_routes(app, serving)
    _add_info_routes(app, serving)
    if debug_endpoints:
        _add_debug_routes(app, serving, ring, verify)
    if ui:
        add_page(app, keyed=bool(api_key), debug_endpoints=debug_endpoints)
    _document(app, serving, bool(api_key))
    rejected = _rejections(serving)
    app.add_middleware(BodyLimit, max_body=max_body, on_reject=rejected)
    if api_key:
        public = OPEN_PATHS + (PUBLIC_PATHS if ui else ())
        app.add_middleware(ApiKey, key=api_key, on_reject=rejected, public=public)
    if allowed_origins:  # outermost: a preflight (OPTIONS, no key) is answered before the key check
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["GET", "POST", "HEAD", "OPTIONS"],
            allow_headers=["*"],
            max_age=600,
        )
    return app


def _rejections(serving: OpenAIServing):
    """What a middleware calls on a request it refuses (401, 413): counted and logged like any other."""

    def rejected(scope, e: APIError) -> None:
        serving.metrics.requests.labels(str(e.status)).inc()
        log.info("%s %s status=%d %s", scope.get("method"), scope.get("path"), e.status, e.message)

    return rejected


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _add_errors(app: FastAPI, serving: OpenAIServing) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        if not getattr(e, "counted", False):  # a request that reached the engine was counted by log_done
            serving.metrics.requests.labels(str(e.status)).inc()
        log.info("%s %s status=%d %s", request.method, request.url.path, e.status, e.message)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return await _api_error(request, from_pydantic(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = "body_too_large" if e.status_code == 413 else None
        return await _api_error(request, APIError(e.status_code, str(e.detail), None, code, e.headers))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return await _api_error(request, APIError(500, f"internal error: {type(e).__name__}", None, "internal_error"))


async def _run(serving: OpenAIServing, mod, req, raw: Request, kind: str):
    """Submit the job; stream its chunks or wait for the whole response."""
    job, params = mod.build_job(serving, req)
    await serving.submit(job, params, "messages" if kind == "chat" else "prompt")
    if req.stream:
        return _EventStream(_sse(serving, mod, req, job, raw, kind), job, serving)
    status = 200
    try:
        async for _ in serving.outputs(job, raw):
            pass
        serving.raise_if_all_failed(job)  # some choices failed: the others are returned, status 200
        return mod.response(serving, req, job)
    except APIError as e:
        status, e.counted = e.status, True
        raise
    except ClientGone:
        status = 499  # nginx's "client closed request": nobody reads this response
        return JSONResponse({}, status_code=499)
    finally:
        if not job.done and status == 200:
            status = 499  # cancelled (shutdown past the grace period)
        serving.release(job)
        serving.log_done(job, status, kind)


async def _sse(serving, mod, req, job, raw, kind):
    status = 200
    try:
        async for chunk in mod.stream(serving, req, job, raw):
            yield chunk
    except APIError as e:  # headers are gone: the error travels as an event, then [DONE]
        status = e.status
        yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"
    except ClientGone:
        status = 499
    finally:  # also on cancellation (client gone, server shutting down): abort what is live
        if not job.done and status == 200:
            status = 499  # the response ended before the engine did: the client left (or shutdown)
        serving.release(job)
        serving.log_done(job, status, kind + "-stream")


class _EventStream(StreamingResponse):
    """SSE response that releases its job even if the body generator never started (a send that
    failed before the first chunk): otherwise the job's engine requests and slots would leak."""

    def __init__(self, body, job, serving) -> None:
        super().__init__(body, media_type="text/event-stream")
        self.job, self.serving = job, serving

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.job.released:
                self.serving.release(self.job)
                self.serving.log_done(self.job, 499, "stream-not-started")


def _add_api_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request):
        return await _run(serving, completions, req, raw, "completion")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request):
        return await _run(serving, chat, req, raw, "chat")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if isinstance(req, TokenizeMessages):
            ids = serving.chat_prompt(ChatCompletionRequest.model_construct(messages=req.messages))
        else:
            ids = serving.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        vocab = serving.llm.config.model.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} outside the vocabulary [0, {vocab})", "tokens", "invalid_value")
        if serving.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens", "no_tokenizer")
        return {"prompt": serving.decode(req.tokens)}


def _add_info_routes(app: FastAPI, serving: OpenAIServing) -> None:
    def card() -> dict:
        return {
            "id": serving.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "mlaserve",
            "max_model_len": serving.max_model_len,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return card()

    @app.get("/health", response_class=PlainTextResponse)
    async def health():
        if not serving.loop.alive:
            raise APIError(503, "the engine loop is not running", None, "engine_dead")
        return PlainTextResponse("ok")

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    for path, endpoint in (("/health", health), ("/metrics", metrics)):  # HEAD: the GET without its body
        app.add_api_route(path, endpoint, methods=["HEAD"], response_class=PlainTextResponse, include_in_schema=False)


def _add_debug_routes(app: FastAPI, serving: OpenAIServing, ring, verify) -> None:
    @app.get("/debug/routes")
    async def routes(last: int = Query(20, ge=0), since: int = Query(0, ge=0)):
        """The last `last` ledger records numbered >= since; `next`: the number to ask for next time
        (a poller passes it back as since and gets only new records)."""
        records, total = ring.since(since) if ring is not None else ([], 0)
        return {"records": records[-last:] if last else [], "next": total}

    @app.get("/debug/config")
    async def config(paths: bool = False):
        """paths=true shows absolute paths; otherwise a path shows as its last part."""
        cfg = serving.llm.config

        def show(v):
            v = jsonable(v)
            return Path(v).name if isinstance(v, str) and not paths and Path(v).is_absolute() else v

        table = [{"name": s.name, "value": show(s.value), "source": s.source} for s in cfg.all_provenance()]
        out = {"model": show(str(serving.llm.loaded.path)), "served_model_name": serving.served_name}
        out["provenance"] = table
        ranks = getattr(serving.llm.runner, "rank_echoes", None)  # tensor parallel: what each rank reported
        if ranks:
            out["ranks"] = ranks
        return out

    @app.get("/debug/provenance")
    async def provenance():
        """Every setting with its source, and where the checkpoint's config.json says otherwise."""
        path = Path(str(serving.llm.loaded.path))
        checkpoint, compared = checkpoint_config(path)
        rows = provenance_rows(serving.llm.config.all_provenance(), checkpoint)
        ranks = getattr(serving.llm.runner, "rank_echoes", None) or []
        return {"model": path.name, "compared_with": compared, "settings": rows, "ranks": ranks}

    @app.get("/debug/kernels")
    async def kernels():
        return kernel_rows(serving.llm.loaded.kernel_plan)

    @app.get("/debug/verify")
    async def verified():
        return verify_rows(verify)


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
_WHY = {
    400: "invalid request (OpenAI error body naming the field)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body too large",
    429: "server busy: retry after Retry-After seconds",
    500: "the engine failed every choice of the request",
    503: "the engine loop is not running",
}


def _document(app: FastAPI, serving: OpenAIServing, keyed: bool) -> None:
    """The OpenAPI document states what the server does: errors are 400 with an OpenAI error body (not
    FastAPI's 422), every status a route can answer is listed, streams are text/event-stream, token ids
    are below the vocabulary size and token-id prompts shorter than the context."""

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = _ERROR_SCHEMA
        err = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                codes = set()
                if method == "post" or op.get("parameters"):
                    codes |= {400}
                if method == "post":
                    codes |= {404, 413}
                if path.startswith("/v1/") and method == "post":
                    codes |= {429, 500, 503}
                if path == "/health":
                    codes |= {503}
                if path.startswith("/v1/models/"):
                    codes |= {404}
                if keyed and path not in OPEN_PATHS:
                    codes |= {401}
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in sorted(codes):
                    responses[str(code)] = {"description": _WHY[code], "content": err}
                if path in ("/v1/completions", "/v1/chat/completions"):
                    responses["200"]["content"]["text/event-stream"] = {"schema": {}}  # chunks, then [DONE]
        vocab, ctx = serving.llm.config.model.vocab_size, serving.max_model_len
        _bound_ids(schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}), vocab - 1, ctx - 1)
        _bound_ids(schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {}), vocab - 1, None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):  # {token id as a string: bias}
            bias = schemas.get(name, {}).get("properties", {}).get("logit_bias")
            if bias is not None:
                bias["propertyNames"] = {"pattern": below(vocab)}
                bias["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


def _bound_ids(node, top: int, max_items: int | None) -> None:
    """Token ids in this schema: at most `top`; arrays of them at most `max_items` long."""
    if isinstance(node, list):
        for n in node:
            _bound_ids(n, top, max_items)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = top
        items = node.get("items")
        if max_items and node.get("type") == "array" and isinstance(items, dict) and items.get("type") == "integer":
            node["maxItems"] = max_items
        for v in node.values():
            if isinstance(v, (dict, list)):
                _bound_ids(v, top, max_items)


class BodyLimit:
    """ASGI middleware: bodies over max_body bytes get 413 before anything parses them (by their
    Content-Length, or while a chunked body is read)."""

    def __init__(self, app, max_body: int, on_reject=None) -> None:
        self.app, self.max_body, self.on_reject = app, max_body, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            e = APIError(413, f"request body over {self.max_body} bytes", None, "body_too_large")
            if self.on_reject is not None:
                self.on_reject(scope, e)
            return await _send_error(send, e)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_body:  # chunked upload without a length: stop reading it
                    # FastAPI passes an HTTPException raised while reading the body on to the handlers
                    raise HTTPException(413, f"request body over {self.max_body} bytes")
            return msg

        return await self.app(scope, limited, send)


class ApiKey:
    """ASGI middleware: `Authorization: Bearer KEY` on every path but the public ones (/health,
    /metrics, and the web page's static files when it is served); compared in constant time."""

    def __init__(self, app, key: str, on_reject=None, public: tuple[str, ...] = OPEN_PATHS) -> None:
        self.app, self.key, self.on_reject, self.public = app, key.encode(), on_reject, public

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
        token = auth[7:] if auth[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(token, self.key):
            e = APIError(401, "missing or wrong API key", None, "invalid_api_key")
            if self.on_reject is not None:
                self.on_reject(scope, e)
            return await _send_error(send, e)
        return await self.app(scope, receive, send)


async def _send_error(send, e: APIError) -> None:
    body = json.dumps(e.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
