"""POST /inference/v1/generate, vLLM's tokens in, tokens out: a prompt's token ids and vLLM's
SamplingParams in; each choice's token ids, their logprobs (tokens named "token_id:<id>") and the
weight version out. Nothing is detokenized on the way (stop strings, which need text, are refused:
stop_token_ids end a choice). A trainer's rollouts come this way (docs/rl.md)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from quart import Blueprint, Response

from api.errors import APIError
from api.generation import admit, generation, stream_error_status
from api.logprobs import finite, prompt_logprobs
from api.protocol import GenerationRequest, parse_completion
from api.response_models import FinishReason, PromptLogprobs, StopReason, Wire
from api.sse import DONE, new_id, sse
from api.state import APIState, api_state, json_body
from jaxserve.engine.outputs import Update
from jaxserve.sched.sequence import TokenLogprobs

tokens_io = Blueprint("tokens_io", __name__)


# vLLM's answer (its GenerateResponse), each token named "token_id:<id>"
class TokenLogprob(Wire):
    token: str  # "token_id:<id>"
    logprob: float


class GeneratedLogprob(TokenLogprob):
    top_logprobs: list[TokenLogprob]


class GeneratedLogprobs(Wire):
    content: list[GeneratedLogprob]


class GenerateChoice(Wire):
    index: int
    token_ids: list[int]  # (in a stream: those new in this chunk)
    logprobs: GeneratedLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class GenerateResponse(Wire):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: None = None  # vLLM's; no KV transfer here
    weight_version: int  # jaxserve's: the newest weights its tokens were sampled under (docs/rl.md)


FIELDS = ("request_id", "token_ids", "sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
          "min_weight_version", "features", "kv_transfer_params")


@tokens_io.post("/inference/v1/generate")
async def generate():
    state = api_state()
    body = await json_body()
    named = body.get("request_id")  # (the answer's; the engine's is the server's own: two may share one)
    if named is not None and not isinstance(named, str):
        raise APIError("'request_id' must be a string", param="request_id")
    request_id = new_id("gen")
    req = await admit(state, _parse(body, state), request_id, chat=False)
    if req.stream:
        return Response(_events(state, req, request_id, named), content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache"})
    choices = [GenerateChoice(index=c, token_ids=[], logprobs=_logprobs(req, [], [])) for c in range(req.params.n)]
    response = GenerateResponse(request_id=named or request_id, choices=choices, weight_version=0)
    try:
        async for _, update in generation(state, req, request_id, named):
            _add(response, choices[update.index], update, req)
    except ValueError as e:
        raise APIError(str(e)) from e
    return response


def abort_requests(state: APIState, request_ids: list[str] | None) -> int:
    """End the requests in flight with these ids (a response's id, or a request_id given to
    /inference/v1/generate; none: every request), each choice's last update saying finish reason
    "abort" -> vLLM's count: the ids given, or the requests in flight."""
    if request_ids and not (isinstance(request_ids, list) and all(isinstance(r, str) for r in request_ids)):
        raise APIError("'request_ids' must be a list of strings", param="request_ids")
    if not request_ids:
        state.engine.abort_requests(None)
        return state.in_flight
    state.engine.abort_requests({own for r in request_ids for own in state.named.get(r, {r})})
    return len(request_ids)


@tokens_io.post("/inference/v1/abort_requests")
async def abort():
    """vLLM's: {"request_ids": [...]} (none: every request); an empty 200."""
    abort_requests(api_state(), (await json_body()).get("request_ids"))
    return Response("", status=200)


def _parse(body: dict, state: APIState) -> GenerationRequest:
    """The request as a completion of its token ids (the sampling fields read as that route reads
    them), without detokenizing."""
    if unknown := sorted(set(body) - set(FIELDS)):
        raise APIError(f"unknown field {unknown[0]!r}", param=unknown[0])
    for name in ("features", "kv_transfer_params"):  # (vLLM's, for multimodal inputs and KV transfer)
        if body.get(name) is not None:
            raise APIError(f"'{name}' is not supported: this server has no multimodal inputs nor KV transfer",
                           param=name)
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise APIError("'token_ids' (the prompt's token ids) is required: a non-empty list of integers",
                       param="token_ids")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise APIError("'sampling_params' must be an object of vLLM's SamplingParams fields", param="sampling_params")
    sampling = dict(sampling)
    if sampling.pop("detokenize", False):
        raise APIError("this route never detokenizes: leave 'detokenize' out, or use /v1/completions",
                       param="sampling_params.detokenize")
    if sampling.get("stop"):
        raise APIError("stop strings need text, and this route makes none: use 'stop_token_ids'",
                       param="sampling_params.stop")
    routed = {name: body[name] for name in ("model", "stream", "stream_options", "cache_salt", "priority",
                                           "min_weight_version") if body.get(name) is not None}
    req = parse_completion({**sampling, **routed, "prompt": token_ids}, state.limits, None)
    return dataclasses.replace(req, params=dataclasses.replace(req.params, detokenize=False))


def _logprobs(req: GenerationRequest, token_ids: list[int], logprobs: list[TokenLogprobs]) -> GeneratedLogprobs | None:
    if req.params.logprobs is None:
        return None
    return GeneratedLogprobs(content=[GeneratedLogprob(token=f"token_id:{token}", logprob=finite(lp.logprob),
                                                       top_logprobs=[TokenLogprob(token=f"token_id:{t}",
                                                                                  logprob=finite(v))
                                                                     for t, v in zip(lp.top_ids, lp.top_logprobs)])
                                      for token, lp in zip(token_ids, logprobs)])


def _add(response: GenerateResponse, choice: GenerateChoice, update: Update, req: GenerationRequest) -> None:
    """An update into the response (a stream's chunk, or the whole answer)."""
    choice.token_ids += update.token_ids
    if choice.logprobs is not None:
        choice.logprobs.content += _logprobs(req, update.token_ids, update.logprobs).content
    choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
    response.weight_version = max(response.weight_version, update.weight_version)
    if update.prompt_logprobs is not None and response.prompt_logprobs is None:
        response.prompt_logprobs = prompt_logprobs(None, req.prompts[0], update.prompt_logprobs)


async def _events(state: APIState, req: GenerationRequest, request_id: str, named: str | None
                  ) -> AsyncIterator[str]:
    """A chunk per update: the choice's new tokens (and their logprobs), its finish at the end."""
    try:
        async for _, update in generation(state, req, request_id, named):
            choice = GenerateChoice(index=update.index, token_ids=[], logprobs=_logprobs(req, [], []))
            chunk = GenerateResponse(request_id=named or request_id, choices=[choice], weight_version=0)
            _add(chunk, choice, update, req)
            yield sse(chunk.dump())
    except Exception as e:  # after the 200, an error can only be an event in the stream
        status = stream_error_status(state, e)
        yield sse((e if isinstance(e, APIError) else APIError(str(e), status=status)).body())
    yield DONE
