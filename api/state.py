"""What every route reads: the serving state of one app (`APIState`), kept on the app, and the
request body as a JSON object.

The state is built once by `create_app`; the routes find it with `api_state()` and hold no state
of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from quart import current_app, request

from api.errors import APIError
from api.limits import Limits
from api.metrics import Metrics
from api.response_store import ResponseStore
from api.tool_parsers import ToolParser
from jaxserve.engine.replicas import Replicas
from jaxserve.engine.tokenizer import Tokenizer

T = TypeVar("T")
_EXTENSION = "jaxserve"  # the key of the state in `app.extensions`


@dataclasses.dataclass
class APIState:
    engine: Replicas  # (one, or data-parallel replicas)
    limits: Limits
    tool_parser: ToolParser  # reads "auto" tool calls
    metrics: Metrics
    responses: ResponseStore  # the Responses API's stored answers (`api/response_store.py`)
    api_keys: tuple[str, ...] = ()  # --api-key: the keys the guarded routes take (none: no key asked)
    auto_tool_choice: bool = True  # vLLM's --enable-auto-tool-choice: "auto" tools are served
    log_requests: bool = False  # one log line per request as it starts
    reasoning_parser: str | None = None  # `api/reasoning.py`: the thinking apart from the answer
    # renders and tokenizes prompts: one thread, in order, as vLLM's
    tokenizing: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    in_flight: int = 0  # requests being generated (vLLM's server load)
    # the ids clients name requests by (vLLM's: X-Request-Id, `request_id`; several may share one) -> the
    # server's ids, while they run (`generation.request_ids`)
    named: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    draining: bool = False  # stopping: /health says 503, new requests get a 503, those in flight go on
    # a streamed weight update under way (`api/rl.py`): each replica's tensors so far, and the version asked for
    staged_weights: list | None = None
    staged_version: int | None = None
    weights_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)  # one upload at a time

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None where the server runs on token ids alone (--skip-tokenizer-init)."""
        return self.engine.tokenizer

    def text_tokenizer(self, route: str) -> Tokenizer:
        """The tokenizer, for a route that cannot do without one; a 400 saying so where there is none."""
        if self.tokenizer is None:
            raise APIError(f"{route} needs the model's tokenizer, and this server runs without one "
                           "(--skip-tokenizer-init): send prompts as token ids to /v1/completions")
        return self.tokenizer

    async def off_loop(self, fn: Callable[..., T], *args) -> T:
        """fn(*args), which renders or tokenizes prompts, on the tokenizing thread: a long prompt must
        not hold up the event loop, and every stream and request with it."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def install(self, app) -> None:
        app.extensions[_EXTENSION] = self
        app.after_serving(self._stop_tokenizing)

    async def _stop_tokenizing(self) -> None:
        self.tokenizing.shutdown(wait=False)


def api_state() -> APIState:
    """The state of the app serving the current request."""
    return api_state_of(current_app)


def api_state_of(app) -> APIState:
    return app.extensions[_EXTENSION]


async def json_body() -> dict:
    """The request's body, a JSON object of valid Unicode (whatever its Content-Type says)."""
    raw = await request.get_data()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from e
    except RecursionError as e:  # (Python's parser gives up on deep nesting; a client's error, not ours)
        raise APIError("the request body's JSON is nested too deeply") from e
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:  # lone surrogates ("\ud800") cannot be tokenized
        raise APIError(f"the request body holds text that is not valid Unicode: {e}") from e
    return body
