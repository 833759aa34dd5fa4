"""The Quart app: OpenAI's routes (and vLLM's extras) over an AsyncEngine.

Routes: GET /health, GET /metrics, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /v1/responses (`api/openai_responses.py`), POST /tokenize,
POST /detokenize. Every error is
OpenAI's body `{"error": {message, type, param, code}}`. A request fans out into
one engine request per prompt, each with n sequences; choice `i * n + j` is
sequence j of prompt i (`api/choices.py` gathers them). Streaming responses are server-sent events ended by
`data: [DONE]`. When the client goes away Quart cancels the handler, which
aborts the request's sequences (their pages are freed at the next step).
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from api.cors import CorsPolicy
from api.metrics import Metrics
from api.openai_responses import ResponseBuilder, chat_request
from api.protocol import APIError, GenerationRequest, Limits, check_model, parse_chat, parse_completion
from api.choices import Choices, merged
from api.reasoning import opens_thinking, thinking_first
from api.responses import new_id, now, sse
from api.tool_parsers import ToolParser, parser_for_template
from jaxserve.async_engine import AsyncEngine, Update
from jaxserve.beam_search import BeamSearchParams
from jaxserve.engine import Logprob
from jaxserve.sequence import TokenLogprobs

log = logging.getLogger(__name__)


def _round_logprobs(token: int, candidates: dict[int, Logprob], k: int) -> TokenLogprobs:
    """A beam search round's candidates as the sampler's logprobs of `token`: its own and the top k."""
    top = sorted(candidates.items(), key=lambda item: item[1].rank)[:k]
    chosen = candidates[token]
    return TokenLogprobs(logprob=chosen.logprob, rank=chosen.rank, top_ids=[t for t, _ in top],
                         top_logprobs=[lp.logprob for _, lp in top])


def create_app(engine: AsyncEngine, limits: Limits, api_key: str | None = None,
               tool_parser: ToolParser | None = None, auto_tool_choice: bool = True,
               log_requests: bool = False, cors: CorsPolicy = CorsPolicy(),
               reasoning_parser: str | None = None) -> Quart:
    """The app; `tool_parser` reads "auto" tool calls (default: the one the chat template points to).
    Without `auto_tool_choice` a request whose tools are chosen "auto" is a 400, as in vLLM without
    --enable-auto-tool-choice ("required" and a named function are still served). `log_requests`
    logs each request as it starts. `cors` says which web pages may call the API (any, by default).
    `reasoning_parser` (`api/reasoning.py`) puts a reasoning model's thinking apart from the answer."""
    app = Quart("jaxserve")
    app.config["RESPONSE_TIMEOUT"] = None  # a long stream must not be cut off (Quart's default is 60 s)
    app.json.sort_keys = False  # a completion's top_logprobs are in rank order, as in the stream
    tokenizer = engine.tokenizer
    tool_parser = tool_parser or parser_for_template(tokenizer.hf.chat_template)
    metrics = Metrics(engine, limits.served_model_name)
    cors.install(app)  # its preflight answer comes before the API key check

    def stream_error_status(e: Exception) -> int:
        """The status of an error met after a stream's 200 (a request the engine refused: 400), counted."""
        status = 400 if isinstance(e, ValueError) else 500
        metrics.error(status)
        return status

    def error_response(e: APIError):
        metrics.error(e.status)
        return e.body(), e.status

    @app.errorhandler(APIError)
    async def api_error(e: APIError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException):  # unknown route, wrong method, body too large, ...
        return error_response(APIError(f"{e.name}: {request.method} {request.path}", status=e.code))

    @app.errorhandler(Exception)
    async def internal(e: Exception):
        log.exception("request failed")
        return error_response(APIError(f"internal error: {e}", status=500, type="internal_error"))

    @app.before_request
    async def authenticate():
        if api_key and request.path.startswith(("/v1", "/invocations")):
            header = request.headers.get("Authorization", "")
            given = header[len("Bearer "):] if header.startswith("Bearer ") else ""
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                raise APIError("invalid or missing API key (send 'Authorization: Bearer KEY')", status=401,
                               type="authentication_error", code="invalid_api_key")

    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # as vLLM's: one thread, in order

    @app.after_serving
    async def stop_tokenizing():
        tokenizing.shutdown(wait=False)

    async def off_loop(fn, *args):
        """fn(*args), which renders or tokenizes prompts, on the tokenizing thread: a long prompt must
        not hold up the event loop, and every stream and request with it."""
        return await asyncio.get_running_loop().run_in_executor(tokenizing, fn, *args)

    async def json_body() -> dict:
        raw = await request.get_data()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}") from e
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:  # lone surrogates ("\ud800") cannot be tokenized
            raise APIError(f"the request body holds text that is not valid Unicode: {e}") from e
        return body

    @app.get("/health")
    @app.route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's health check)
    async def health():
        return ("", 200) if engine.is_running else ({"error": "engine not running"}, 503)

    @app.get("/load")
    async def load():
        """vLLM's: the requests being generated."""
        return {"server_load": in_flight[0]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict:
        created = now()
        return {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                "root": limits.model_root or name, "parent": None, "max_model_len": limits.max_model_len,
                "permission": [{"id": new_id("modelperm"), "object": "model_permission", "created": created,
                                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in limits.model_names]}

    @app.get("/v1/models/<path:model>")
    async def model(model: str):
        check_model({"model": model}, limits)
        return model_card(model)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("jaxserve")}

    in_flight = [0]  # requests being generated (vLLM's server load)

    async def generation(req: GenerationRequest, request_id: str) -> AsyncIterator[tuple[int, Update]]:
        """The updates of all the request's sequences (`merged`), counted in the server's load meanwhile."""
        in_flight[0] += 1
        try:
            async for item in merged(streams(req, request_id)):
                yield item
        finally:
            in_flight[0] -= 1

    def streams(req: GenerationRequest, request_id: str) -> list[AsyncIterator[Update]]:
        if log_requests:
            log.info("request %s: prompt tokens %s, %s", request_id, [len(ids) for ids in req.prompts],
                     req.beam or req.params)
        return [metrics.timed(beam_search(f"{request_id}-{i}", ids, req.beam, req.params.logprobs)
                              if req.beam is not None else engine.generate(f"{request_id}-{i}", ids, req.params),
                              req.params.n)
                for i, ids in enumerate(req.prompts)]

    async def beam_search(request_id: str, ids: list[int], params: BeamSearchParams,
                          logprobs: int | None) -> AsyncIterator[Update]:
        """The best beams, best first, as the n choices' one update each (once the search is over).
        With `logprobs` k, each token's are those of the round that chose it: its logprob and rank,
        and the top k of the 2 x n candidates the round weighed (as vLLM's, at most 2 x n)."""
        result = await engine.beam_search(request_id, ids, params)
        for index, beam in enumerate(result.sequences):
            tokens = beam.tokens[len(ids):]
            yield Update(index=index, text=beam.text, token_ids=tokens, num_prompt_tokens=len(ids),
                         logprobs=[] if logprobs is None else [
                             _round_logprobs(token, candidates, logprobs)
                             for token, candidates in zip(tokens, beam.logprobs)],
                         num_cached_tokens=0, num_output_tokens=len(tokens), finish_reason=beam.finish_reason,
                         stop_reason=None)  # (an EOS, as a sampled one reports it)

    def admit(req: GenerationRequest, chat: bool) -> None:
        """400 before anything is sent where the request cannot run: "auto" tools the server does not
        serve, or a prompt the engine would refuse. A chat request's constraint waits for the thinking
        (--reasoning-parser)."""
        if chat and reasoning_parser:
            if req.echo:
                raise APIError("'echo' is not supported with --reasoning-parser", param="echo")
            req.thinking = opens_thinking(reasoning_parser, tokenizer, req.prompts[0])  # (chat: one prompt)
            req.params.constraint = thinking_first(req.params.constraint, req.thinking)
        if req.tools is not None and req.tools.mode == "auto" and not auto_tool_choice:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice (the server runs with '
                           '--no-enable-auto-tool-choice)', param="tool_choice")
        if req.tools is not None and req.tools.mode == "auto" and tool_parser.name == "mistral":
            req.params.skip_special_tokens = False  # [TOOL_CALLS] is a special token
        try:
            for ids in req.prompts:
                engine.check(ids, req.params)
        except ValueError as e:
            raise APIError(str(e)) from e

    async def run(req: GenerationRequest, request_id: str, chat: bool) -> Response | dict:
        admit(req, chat)
        head = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": req.model}
        if req.stream:
            return Response(stream(req, request_id, chat, head), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        choices = Choices(req, chat, engine, tool_parser)
        try:
            async for i, update in generation(req, request_id):
                choices.add(choices.choice_index(i, update), update)
        except ValueError as e:
            raise APIError(str(e)) from e
        return choices.body(head)

    async def stream(req: GenerationRequest, request_id: str, chat: bool, head: dict) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if req.include_usage else {}
        choices = Choices(req, chat, engine, tool_parser)

        prompt_ids_sent = [False] * len(choices.texts)

        def chunk(c: int, delta: dict | None = None, text: str | None = None, logprobs=None,
                  finish_reason: str | None = None, stop_reason=None) -> str:
            if chat:
                choice = {"index": c, "delta": delta or {},
                          "logprobs": None if logprobs is None else {"content": logprobs}}
            else:
                choice = {"index": c, "text": text or "", "logprobs": logprobs}
            choice.update(finish_reason=finish_reason, stop_reason=stop_reason)
            if delta is None or "role" not in delta:
                choice.update(choices.ids_to_send(c))
            prompt_ids = {}  # vLLM's return_token_ids: the prompt's in each choice's first chunk
            if req.return_token_ids and not prompt_ids_sent[c]:
                prompt_ids_sent[c] = True
                prompt_ids = {"prompt_token_ids": req.prompts[c // req.params.n]}
            if not chat:
                choice, prompt_ids = {**choice, **prompt_ids}, {}
            if req.continuous_usage:
                return sse({**head, **prompt_ids, "choices": [choice], "usage": choices.choice_usage(c)})
            return sse({**head, **prompt_ids, "choices": [choice], **extra})

        for c in range(len(choices.texts)) if chat else ():
            yield chunk(c, {"role": req.role, "content": ""})
        try:
            async for i, update in generation(req, request_id):
                c = choices.choice_index(i, update)
                text, logprobs = choices.add(c, update)
                if chat:
                    # a token whose text is held back still brings its logprobs (with no content, as vLLM's)
                    ds = choices.deltas(c, text, update.finish_reason is not None) or (
                        [{"content": ""}] if logprobs else [])
                    for k, delta in enumerate(ds):
                        yield chunk(c, delta, logprobs=logprobs if k == 0 else None)
                elif text or (logprobs and logprobs["tokens"]):
                    yield chunk(c, text=text, logprobs=logprobs)
                if update.finish_reason is not None:
                    yield chunk(c, finish_reason=choices.finish_reason(c), stop_reason=update.stop_reason)
        except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
            yield sse(APIError(str(e), status=stream_error_status(e)).body())
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": choices.usage()})
        yield "data: [DONE]\n\n"

    async def completion(body: dict):
        return await run(await off_loop(parse_completion, body, limits, tokenizer), new_id("cmpl"), chat=False)

    async def chat_completion(body: dict):
        return await run(await off_loop(parse_chat, body, limits, tokenizer), new_id("chatcmpl"), chat=True)

    @app.post("/v1/completions")
    async def completions():
        return await completion(await json_body())

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await chat_completion(await json_body())

    async def respond(req: GenerationRequest, builder: ResponseBuilder) -> AsyncIterator[str]:
        """The Responses events of a chat request's one choice (`api/openai_responses.py`)."""
        choices = Choices(req, True, engine, tool_parser)
        for event in builder.start():
            yield event
        async for _, update in generation(req, builder.response["id"]):
            answering = choices.reasoning is None or choices.reasoning[0].state == "content"
            text, logprobs = choices.add(0, update)
            logprobs = logprobs if answering else None  # (output_text's logprobs: none of the thinking's tokens)
            for k, delta in enumerate(choices.deltas(0, text, update.finish_reason is not None) or [{}]):
                for event in builder.delta(delta, logprobs if k == 0 else None):
                    yield event
        for event in builder.finish(choices.finish_reason(0), choices.usage()):
            yield event

    async def respond_streamed(req: GenerationRequest, builder: ResponseBuilder) -> AsyncIterator[str]:
        try:
            async for event in respond(req, builder):
                yield event
        except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
            status = stream_error_status(e)
            for event in builder.failed(str(e), "invalid_request_error" if status == 400 else "server_error"):
                yield event

    @app.post("/invocations")
    async def invocations():
        """vLLM's (SageMaker's) one route for both APIs: chat where the body has messages, else completions."""
        body = await json_body()
        if "messages" in body:
            return await chat_completion(body)
        if "prompt" in body:
            return await completion(body)
        raise APIError("/invocations takes a chat request (with 'messages') or a completions request (with 'prompt')")

    @app.post("/v1/responses")
    async def responses():
        body = await json_body()
        req = await off_loop(parse_chat, chat_request(body), limits, tokenizer)
        admit(req, chat=True)
        builder = ResponseBuilder(new_id("resp", "_"), body, req.model, req.params.temperature,
                                  req.params.top_p, logprobs=req.params.logprobs is not None)
        if req.stream:
            return Response(respond_streamed(req, builder), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        try:
            async for _ in respond(req, builder):
                pass
        except ValueError as e:
            raise APIError(str(e)) from e
        return builder.response

    @app.post("/tokenize")
    async def tokenize():
        body = await json_body()
        check_model(body, limits)
        if "messages" in body:
            rendering = {k: body[k] for k in ("messages", "tools", "add_generation_prompt", "continue_final_message",
                                              "chat_template", "chat_template_kwargs", "add_special_tokens",
                                              "reasoning_effort")
                         if k in body}
            ids = (await off_loop(parse_chat, {**rendering, "max_tokens": 1}, limits, tokenizer)).prompts[0]
        elif isinstance(body.get("prompt"), str):
            ids = await off_loop(tokenizer.encode, body["prompt"], body.get("add_special_tokens", True) is True)
        else:
            raise APIError("send 'prompt' (a string) or 'messages'", param="prompt")
        strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.get("return_token_strs") is True else None
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize():
        body = await json_body()
        check_model(body, limits)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < limits.vocab_size for t in ids):
            raise APIError(f"'tokens' must be a list of token ids in [0, {limits.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(ids)}

    return app
