"""Running a parsed request on the engine, for every generating route (chat, completions,
Responses): the checks before anything is sent (`admit`), and the updates of all of the request's
sequences as they come (`generation`), counted in the server's load meanwhile.

A request fans out into one engine request per prompt, each with n sequences; choice `i * n + j`
is sequence j of prompt i (`api/choices.py` gathers them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from quart import request

from api.errors import APIError
from api.protocol import GenerationRequest
from api.reasoning import opens_thinking, thinking_first
from api.sse import new_id
from api.state import APIState
from jaxserve.config.lora import LoRARequest
from jaxserve.engine.beam_search import BeamSearchParams
from jaxserve.engine.outputs import Logprob, Update
from jaxserve.errors import QueueFull, ReplicaLost, RequestError, StepFailed
from jaxserve.sched.sequence import TokenLogprobs

log = logging.getLogger(__name__)

RETRY_AFTER = "1"  # seconds a client refused for a full queue or a draining server waits before retrying


def shutting_down() -> APIError:
    """The 503 of a server draining before it stops: for new requests, and for /health."""
    return APIError("the server is shutting down: send the request to another replica", status=503,
                    type="service_unavailable", code="shutting_down", headers={"Retry-After": RETRY_AFTER})


async def admit(state: APIState, req: GenerationRequest, request_id: str, chat: bool) -> GenerationRequest:
    """400 before anything is sent where the request cannot run: "auto" tools the server does not
    serve, a prompt the engine would refuse, or a constraint that does not compile (in time: it is
    compiled on the tokenizing thread, not the event loop, before the request reaches the engine);
    then 503 where the bounded waiting queue has no room for it (`Replicas.admit`: last, so a
    refused request holds no place in it). A chat request's constraint waits for the thinking
    (--reasoning-parser). The adapter its `model` names (if any) is taken now: one unloaded later
    serves the requests admitted before. -> the request as it runs."""
    if req.pooling != (state.limits.pooler is not None):
        raise APIError("this server runs an embedding model (--runner pooling): POST /v1/embeddings" if not req.pooling
                       else "The model does not support the Embeddings API: it generates text (an embedding model runs "
                       "with --runner pooling)")
    req = dataclasses.replace(req, lora=state.limits.adapters.get(req.model))
    if chat and state.reasoning_parser:
        if req.echo:
            raise APIError("'echo' is not supported with --reasoning-parser", param="echo")
        thinking = opens_thinking(state.reasoning_parser, state.tokenizer, req.prompts[0])  # (chat: one prompt)
        req = dataclasses.replace(req, thinking=thinking,
                                  params=req.params.with_constraint(thinking_first(req.params.constraint, thinking)))
    auto_tools = req.tools is not None and req.tools.mode == "auto"
    if auto_tools and not state.auto_tool_choice:
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice (the server runs with '
                       '--no-enable-auto-tool-choice)', param="tool_choice")
    if auto_tools and state.tool_parser.name == "mistral":
        # ([TOOL_CALLS] is a special token)
        req = dataclasses.replace(req, params=dataclasses.replace(req.params, skip_special_tokens=False))
    try:
        for ids in req.prompts:
            state.engine.check(ids, req.params, priority=req.priority, cache_salt=req.cache_salt)
    except RequestError as e:  # the engine's one check of what depends on the model
        field = {"prompt": req.prompt_field, "logprobs": "top_logprobs" if chat else "logprobs"}.get(e.field, e.field)
        raise APIError(str(e), param=field) from e
    except ValueError as e:
        raise APIError(str(e)) from e
    if req.params.constraint is not None:
        try:
            await state.off_loop(state.engine.check_constraint, req.params.constraint)
        except ValueError as e:
            raise APIError(str(e)) from e
    try:
        state.engine.admit([(f"{request_id}-{i}", ids) for i, ids in enumerate(req.prompts)], req.cache_salt)
    except QueueFull as e:
        raise APIError(str(e), status=503, type="server_overloaded", code="queue_full",
                       headers={"Retry-After": RETRY_AFTER}) from e
    return req


async def generation(state: APIState, req: GenerationRequest, request_id: str, shown: str | None = None
                     ) -> AsyncIterator[tuple[int, Update]]:
    """(prompt index, update) of all the request's sequences as they come (`merged`), counted in the
    server's load meanwhile; `shown`, the id the client knows it by (where it is not `request_id`),
    finds it meanwhile (`abort_requests`). A step that failed while computing them is a 500 (its
    traceback is logged once, by the engine thread); a replica lost after it started answering, a 503."""
    state.in_flight += 1
    if shown is not None:
        state.named.setdefault(shown, set()).add(request_id)
    try:
        async for item in merged(_streams(state, req, request_id)):
            yield item
    except StepFailed as e:
        raise APIError(str(e), status=500, type="internal_error") from e
    except ReplicaLost as e:  # (after part of the answer was sent: else the request ran on another replica)
        raise APIError(f"the replica generating this request went away: {e}; retry the request", status=503,
                       type="service_unavailable", code="replica_lost", headers={"Retry-After": RETRY_AFTER}) from e
    finally:
        state.in_flight -= 1
        if shown is not None:
            state.named[shown].discard(request_id)
            if not state.named[shown]:
                del state.named[shown]


def request_ids(prefix: str, body: dict) -> tuple[str, str | None]:
    """vLLM's id of an answer, `prefix`-ID where the client names the request (its X-Request-Id header,
    else the body's `request_id`), else a new one -> (the engine's id, unique; the answer's id where it
    differs from the engine's: several requests may share a client's id)."""
    given = request.headers.get("X-Request-Id") or body.get("request_id")
    if given is None:
        return new_id(prefix), None
    if not isinstance(given, str) or not given:
        raise APIError("'request_id' must be a non-empty string", param="request_id")
    return new_id(f"{prefix}-{given}"), f"{prefix}-{given}"


def _streams(state: APIState, req: GenerationRequest, request_id: str) -> list[AsyncIterator[Update]]:
    """One timed stream of updates per prompt."""
    if state.log_requests:
        log.info("request %s: prompt tokens %s, %s", request_id, [len(ids) for ids in req.prompts],
                 req.beam or req.params)
    return [state.metrics.timed(_beam_search(state, f"{request_id}-{i}", ids, req.beam, req.params.logprobs, req.lora)
                                if req.beam is not None else
                                state.engine.generate(f"{request_id}-{i}", ids, req.params, priority=req.priority,
                                                      cache_salt=req.cache_salt,
                                                      min_weight_version=req.min_weight_version,
                                                      lora_request=req.lora),
                                req.params.n, (req.beam or req.params).max_tokens)
            for i, ids in enumerate(req.prompts)]


async def _beam_search(state: APIState, request_id: str, ids: list[int], params: BeamSearchParams,
                       logprobs: int | None, lora_request: LoRARequest | None) -> AsyncIterator[Update]:
    """The best beams, best first, as the n choices' one update each (once the search is over).
    With `logprobs` k, each token's are those of the round that chose it: its logprob and rank,
    and the top k of the 2 x n candidates the round weighed (as vLLM's, at most 2 x n)."""
    result = await state.engine.beam_search(request_id, ids, params, lora_request)
    for index, beam in enumerate(result.sequences):
        tokens = beam.tokens[len(ids):]
        yield Update(request_id=request_id, index=index, text=beam.text, token_ids=tokens, num_prompt_tokens=len(ids),
                     logprobs=[] if logprobs is None else [
                         _round_logprobs(token, candidates, logprobs)
                         for token, candidates in zip(tokens, beam.logprobs)],
                     num_cached_tokens=0, num_output_tokens=len(tokens), finish_reason=beam.finish_reason,
                     stop_reason=None)  # (an EOS, as a sampled one reports it)


def _round_logprobs(token: int, candidates: dict[int, Logprob], k: int) -> TokenLogprobs:
    """A beam search round's candidates as the sampler's logprobs of `token`: its own and the top k."""
    top = sorted(candidates.items(), key=lambda item: item[1].rank)[:k]
    chosen = candidates[token]
    return TokenLogprobs(logprob=chosen.logprob, rank=chosen.rank, top_ids=[t for t, _ in top],
                         top_logprobs=[lp.logprob for _, lp in top])


async def merged(streams: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
    """(stream index, update) from several streams as they come; cancelling cancels them all."""
    if len(streams) == 1:
        async for update in streams[0]:
            yield 0, update
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Update]):
        try:
            async for update in stream:
                await out.put((i, update))
            await out.put((i, done))
        except BaseException as e:
            await out.put((i, e))
            raise

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await out.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stream_error_status(state: APIState, e: Exception) -> int:
    """The status of an error met after a stream's 200 (a request the engine refused: 400), counted."""
    status = e.status if isinstance(e, APIError) else 400 if isinstance(e, ValueError) else 500
    state.metrics.error(status)
    return status
