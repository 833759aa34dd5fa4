"""The Quart app: OpenAI's routes over an AsyncEngine.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
Every error is OpenAI's body `{"error": {message, type, param, code}}`. A
request fans out into one engine sequence per prompt; streaming responses are
server-sent events ended by `data: [DONE]`. When the client goes away Quart
cancels the handler, which aborts the request's sequences (their pages are
freed at the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from api.protocol import APIError, GenerationRequest, Limits, new_id, now, parse_chat, parse_completion, usage
from jaxserve.async_engine import AsyncEngine, Update

log = logging.getLogger(__name__)


async def merged(streams: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
    """(stream index, update) from several streams as they come; cancelling cancels them all."""
    if len(streams) == 1:
        async for update in streams[0]:
            yield 0, update
        return
    out: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Update]):
        try:
            async for update in stream:
                await out.put((i, update))
        except BaseException as e:
            await out.put((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await out.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finish_reason is not None
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def create_app(engine: AsyncEngine, limits: Limits, api_key: str | None = None) -> Quart:
    app = Quart("jaxserve")
    tokenizer = engine.tokenizer

    @app.errorhandler(APIError)
    async def api_error(e: APIError):
        return e.body(), e.status

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):  # unknown route, wrong method, body too large, ...
        return APIError(f"{e.name}: {request.method} {request.path}", status=e.code).body(), e.code

    @app.errorhandler(Exception)
    async def internal(e: Exception):
        log.exception("request failed")
        return APIError(f"internal error: {e}", status=500, type="internal_error").body(), 500

    @app.before_request
    async def authenticate():
        if api_key and request.path.startswith("/v1"):
            header = request.headers.get("Authorization", "")
            given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                               type="authentication_error", code="invalid_api_key")

    async def json_body() -> dict:
        raw = await request.get_data()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return ("", 200) if engine.is_running else ({"error": "engine not running"}, 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": limits.served_model_name, "object": "model", "created": now(),
                                            "owned_by": "jaxserve", "max_model_len": limits.max_model_len}]}

    def streams(req: GenerationRequest, request_id: str) -> list[AsyncIterator[Update]]:
        return [engine.generate(f"{request_id}-{i}", ids, req.params) for i, ids in enumerate(req.prompts)]

    async def run(req: GenerationRequest, request_id: str, chat: bool) -> Response | dict:
        object_name = "chat.completion" if chat else "text_completion"
        head = {"id": request_id, "object": object_name, "created": now(), "model": limits.served_model_name}
        if req.stream:
            return Response(_stream(req, request_id, chat, head), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        texts = [[] for _ in req.prompts]
        finish = [None] * len(req.prompts)
        counts = [0] * len(req.prompts)
        try:
            async for i, update in merged(streams(req, request_id)):
                texts[i].append(update.text)
                finish[i], counts[i] = update.finish_reason, update.num_output_tokens
        except ValueError as e:
            raise APIError(str(e)) from e
        choices = []
        for i in range(len(req.prompts)):
            text = "".join(texts[i])
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": finish[i]})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": finish[i]})
        return {**head, "choices": choices, "usage": usage(sum(map(len, req.prompts)), sum(counts))}

    async def _stream(req: GenerationRequest, request_id: str, chat: bool, head: dict) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if req.include_usage else {}

        def chunk(i: int, content: str | None, finish_reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else (
                    {"content": content} if content is not None else {})
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": i, "text": content or "", "logprobs": None, "finish_reason": finish_reason}
            return _sse({**head, "choices": [choice], **extra})

        if chat:
            for i in range(len(req.prompts)):
                yield chunk(i, None, None, role=True)
        counts = [0] * len(req.prompts)
        try:
            async for i, update in merged(streams(req, request_id)):
                counts[i] = update.num_output_tokens
                if update.text:
                    yield chunk(i, update.text, None)
                if update.finish_reason is not None:
                    yield chunk(i, None, update.finish_reason)
        except (ValueError, RuntimeError) as e:
            yield _sse(APIError(str(e), status=400 if isinstance(e, ValueError) else 500).body())
        if req.include_usage:
            yield _sse({**head, "choices": [], "usage": usage(sum(map(len, req.prompts)), sum(counts))})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions():
        body = await json_body()
        return await run(parse_completion(body, limits, tokenizer), new_id("cmpl"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions():
        body = await json_body()
        return await run(parse_chat(body, limits, tokenizer), new_id("chatcmpl"), chat=True)

    return app
