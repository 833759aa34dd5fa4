"""The Quart app: OpenAI's routes (and vLLM's extras) over an AsyncEngine.

One module per endpoint family, each a Blueprint whose handlers read the app's `APIState`:
`api/chat.py` (POST /v1/chat/completions, /invocations), `api/completions.py` (POST
/v1/completions), `api/responses.py` (POST /v1/responses), `api/tokenize.py` (POST /tokenize,
/detokenize) and `api/server_info.py` (/health, /ping, /load, /metrics, /v1/models, /version).
Every error is OpenAI's body `{"error": {message, type, param, code}}`. The OpenAPI document of
the routes, generated from their request and response models (`api/request_models.py`,
`api/response_models.py`), is served at /openapi.json, and read at /docs (also /redocs, /scalar).
`api/playground.py` serves the browser playground at GET /.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
import uuid
from collections.abc import Sequence

from quart import Quart, current_app, request
from quart_schema import Info, QuartSchema
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from api.chat import chat
from api.completions import completions
from api.cors import CorsPolicy
from api.embeddings import embeddings
from api.errors import APIError
from api.generation import shutting_down
from api.limits import Limits
from api.lora import lora
from api.messages import PATH as MESSAGES_PATH
from api.messages import error_body as anthropic_error_body
from api.messages import messages
from api.metrics import Metrics
from api.playground import playground as playground_pages
from api.profiling import PATHS as PROFILING_PATHS
from api.profiling import profiling_routes
from api.response_store import ResponseStore
from api.responses import responses
from api.rl import PATHS as TRAINING_PATHS
from api.rl import UnboundedWeights, training
from api.server_info import server_info
from api.state import APIState, api_state
from api.stored_responses import stored
from api.tokenize import tokenize
from api.tokens_io import tokens_io
from api.tool_parsers import ToolParser, parser_for_template
from jaxserve.config.profiler import ProfilerConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.replicas import Replicas

log = logging.getLogger(__name__)

KEYED_PATHS = ("/v1", "/invocations", "/inference", *TRAINING_PATHS, *PROFILING_PATHS)  # the routes --api-key guards
MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024  # --max-request-body-bytes' default (Quart's own)
STORED_RESPONSES = 1000  # --max-stored-responses' default


def create_app(engine: Replicas | AsyncEngine, limits: Limits, api_key: str | Sequence[str] | None = None,
               tool_parser: ToolParser | None = None, auto_tool_choice: bool = True,
               log_requests: bool = False, cors: CorsPolicy = CorsPolicy(),
               reasoning_parser: str | None = None, docs: bool = True,
               max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES, playground: bool = True,
               runtime_lora_updating: bool = False, request_id_headers: bool = False, root_path: str = "",
               profiler: ProfilerConfig | None = None, stored_responses: int = STORED_RESPONSES) -> Quart:
    """The app over `engine`'s data-parallel replicas (or one); `api_key`: the key (or any one of the keys)
    the guarded routes (KEYED_PATHS) take; `tool_parser` reads "auto" tool calls (default: the one the chat
    template points to).
    Without `auto_tool_choice` a request whose tools are chosen "auto" is a 400, as in vLLM without
    --enable-auto-tool-choice ("required" and a named function are still served). `log_requests`
    logs each request as it starts. `cors` says which web pages may call the API (any, by default).
    `reasoning_parser` (`api/reasoning.py`) puts a reasoning model's thinking apart from the answer.
    `docs`: serve /openapi.json and its pages (/docs, /redocs, /scalar); off, as vLLM's
    --disable-fastapi-docs, none of them. A request body over `max_request_body_bytes` is a 413: Quart
    refuses it from its Content-Length before reading any of it, and a chunked one as soon as what has
    come exceeds the limit (the rest is not kept). `playground`: serve the browser playground at GET /
    (`api/playground.py`). `runtime_lora_updating`: serve vLLM's routes that load and unload LoRA
    adapters (`api/lora.py`). `request_id_headers`: each response has an X-Request-Id header, the
    request's own or a new one (vLLM's --enable-request-id-headers). `root_path`: the path prefix a
    proxy serves the API under (vLLM's --root-path, `RootPath`). `profiler` (default: the engine's
    `profiler_config`): serve POST /start_profile and /stop_profile, traces of this process
    (`api/profiling.py`). `stored_responses`: how many Responses API answers are kept for GET
    /v1/responses/{id} and `previous_response_id` (0: none)."""
    engine = Replicas([engine]) if isinstance(engine, AsyncEngine) else engine
    profiler = profiler or engine.engine.config.profiler
    app = Quart("jaxserve")
    app.request_class = UnboundedWeights
    app.config["RESPONSE_TIMEOUT"] = None  # a long stream must not be cut off (Quart's default is 60 s)
    app.config["MAX_CONTENT_LENGTH"] = max_request_body_bytes
    paths = {} if docs else dict(openapi_path=None, redoc_ui_path=None, scalar_ui_path=None, swagger_ui_path=None)
    root_path = root_path.rstrip("/")
    QuartSchema(app, info=Info(title="jaxserve", version=importlib.metadata.version("jaxserve")),
                servers=[{"url": root_path}] if root_path else None, **paths)
    if root_path:
        app.asgi_app = RootPath(app.asgi_app, root_path)
    app.json.sort_keys = False  # a completion's top_logprobs are in rank order, as in the stream
    template = None if engine.tokenizer is None else engine.tokenizer.hf.chat_template
    metrics = Metrics(engine, limits.served_model_name)
    app.before_serving(metrics.loop_lag.start)  # (/metrics' event loop lag)
    app.after_serving(metrics.loop_lag.stop)
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    APIState(engine, limits, tool_parser or parser_for_template(template), metrics, auto_tool_choice=auto_tool_choice,
             api_keys=keys, log_requests=log_requests, reasoning_parser=reasoning_parser,
             responses=ResponseStore(stored_responses)).install(app)
    cors.install(app)  # its preflight answer comes before the API key check
    app.before_request(_check_key)
    app.before_request(_check_draining)
    if request_id_headers:
        app.after_request(_request_id_header)
    for error, handler in ((APIError, _api_error), (RequestEntityTooLarge, _body_too_large),
                           (HTTPException, _http_error), (Exception, _internal_error)):
        app.register_error_handler(error, handler)
    optional = ((playground_pages, playground), (lora, runtime_lora_updating),
                (profiling_routes(profiler) if profiler else None, profiler is not None))
    for blueprint in (server_info, completions, chat, responses, stored, messages, embeddings, tokenize, training,
                      tokens_io, *(routes for routes, served in optional if served)):
        app.register_blueprint(blueprint)
    return app


class RootPath:
    """vLLM's --root-path: the API served behind a proxy under a path prefix, as FastAPI's root_path
    routes it: a path under the prefix is routed without it, and one without it (from a proxy that
    strips the prefix) as it is; either way the request's root_path is the prefix, so the URLs the
    app makes (the docs pages' document) carry it. The prefix alone is redirected to itself with a
    slash, under which the playground's relative URLs resolve."""

    def __init__(self, asgi_app, root_path: str):
        self.asgi_app, self.root_path = asgi_app, root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.asgi_app(scope, receive, send)
        path, root = scope["path"], self.root_path
        if path == root and scope["type"] == "http":
            query = scope.get("query_string", b"")
            location = (root + "/").encode() + (b"?" + query if query else b"")
            await send({"type": "http.response.start", "status": 308, "headers": [(b"location", location)]})
            return await send({"type": "http.response.body", "body": b""})
        under = path.startswith(root + "/")
        return await self.asgi_app({**scope, "root_path": root, "path": path if under else root + path}, receive, send)


async def _check_key():
    """--api-key: a 401 on the guarded routes without `Authorization: Bearer KEY` (or Anthropic's
    `x-api-key: KEY`) of one of the keys."""
    keys = api_state().api_keys
    if keys and request.path.startswith(KEYED_PATHS):
        header = request.headers.get("Authorization", "")
        given = header[len("Bearer "):] if header.startswith("Bearer ") else request.headers.get("x-api-key", "")
        if not any([hmac.compare_digest(given.encode(), key.encode()) for key in keys]):  # (each compared)
            raise APIError("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                           type="authentication_error", code="invalid_api_key")


async def _request_id_header(response):
    response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return response


async def _check_draining():
    """While the server drains before stopping, a 503 for new work (the requests in flight go on)."""
    if api_state().draining and request.method == "POST" and request.path != "/ping":
        raise shutting_down()


def _error_response(e: APIError):
    api_state().metrics.error(e.status)
    if request.path.startswith(MESSAGES_PATH):  # (Anthropic's clients read Anthropic's envelope)
        body, status = anthropic_error_body(e)
        return body, status, e.headers
    return e.body(), e.status, e.headers


async def _api_error(e: APIError):
    return _error_response(e)


async def _body_too_large(e: RequestEntityTooLarge):
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    return _error_response(APIError(f"the request body is larger than this server's limit of {limit} bytes "
                                    "(--max-request-body-bytes)", status=413))


async def _http_error(e: HTTPException):  # unknown route, wrong method, body too large, ...
    return _error_response(APIError(f"{e.name}: {request.method} {request.path}", status=e.code))


async def _internal_error(e: Exception):
    log.exception("request failed")
    return _error_response(APIError(f"internal error: {e}", status=500, type="internal_error"))
