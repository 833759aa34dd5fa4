"""The answer to a chat or completions request: the whole response, or a stream of server-sent
chunks ended by `data: [DONE]`. When the client goes away Quart cancels the stream, which aborts
the request's sequences (their pages are freed at the next step)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pydantic import MISSING
from quart import Response

from api.choices import Choices
from api.errors import APIError
from api.generation import admit, generation, stream_error_status
from api.protocol import GenerationRequest
from api.response_models import (ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatLogprob, ChatLogprobs,
                                 Completion, CompletionChunk, CompletionChunkChoice, CompletionLogprobs, DeltaMessage)
from api.sse import DONE, now, sse
from api.state import APIState


async def answer(state: APIState, req: GenerationRequest, request_id: str, chat: bool, shown: str | None = None
                 ) -> Response | ChatCompletion | Completion:
    """`shown`: the answer's id, where it is not the engine's `request_id` (`generation.request_ids`)."""
    req = await admit(state, req, request_id, chat)
    if req.stream:
        chunks = ChunkStream(state, req, request_id, chat, shown)
        return Response(chunks.events(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    created = now()
    choices = Choices(req, chat, state.engine, state.tool_parser)
    try:
        async for i, update in generation(state, req, request_id, shown):
            choices.add(choices.choice_index(i, update), update)
    except ValueError as e:
        raise APIError(str(e)) from e
    answer_id = shown or request_id
    return choices.chat_completion(answer_id, created) if chat else choices.completion(answer_id, created)


async def streamed_or_whole(req: GenerationRequest, stream: Callable[[], AsyncIterator[str]],
                            events: Callable[[], AsyncIterator[str]], whole: Callable[[], object]):
    """The answer of an API whose response grows from its events (Responses, Messages): where the
    request streams, `stream()` as server-sent events (errors among them); else `events()` run to
    their end (a ValueError is a 400), then `whole()`."""
    if req.stream:
        return Response(stream(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        async for _ in events():
            pass
    except ValueError as e:
        raise APIError(str(e)) from e
    return whole()


class ChunkStream:
    """The chunks of one streamed chat or completions answer."""

    def __init__(self, state: APIState, req: GenerationRequest, request_id: str, chat: bool, shown: str | None):
        self.state, self.req, self.request_id, self.chat, self.shown = state, req, request_id, chat, shown
        self.answer_id = shown or request_id
        self.created = now()
        self.choices = Choices(req, chat, state.engine, state.tool_parser)
        self.prompt_ids_sent = [False] * len(self.choices.texts)

    async def events(self) -> AsyncIterator[str]:
        req, choices = self.req, self.choices
        for c in range(len(choices.texts)) if self.chat else ():
            yield self.chat_chunk(c, DeltaMessage(role=req.role, content=""))
        try:
            async for i, update in generation(self.state, req, self.request_id, self.shown):
                c = choices.choice_index(i, update)
                text, logprobs = choices.add(c, update)
                if self.chat:
                    # a token whose text is held back still brings its logprobs (with no content, as vLLM's)
                    ds = choices.deltas(c, text, update.finish_reason is not None) or (
                        [DeltaMessage(content="")] if logprobs else [])
                    for k, delta in enumerate(ds):
                        yield self.chat_chunk(c, delta, logprobs=logprobs if k == 0 else None)
                elif text or (logprobs and logprobs.tokens):
                    yield self.completion_chunk(c, text=text, logprobs=logprobs)
                if update.finish_reason is not None:
                    end = dict(finish_reason=choices.finish_reason(c), stop_reason=update.stop_reason)
                    yield self.chat_chunk(c, DeltaMessage(), **end) if self.chat else self.completion_chunk(c, **end)
        except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
            status = stream_error_status(self.state, e)
            kind = "invalid_request_error" if status < 500 else "internal_error"
            yield sse((e if isinstance(e, APIError) else APIError(str(e), status=status, type=kind)).body())
        if req.include_usage:
            chunk = ChatCompletionChunk if self.chat else CompletionChunk
            yield sse(chunk(id=self.answer_id, created=self.created, model=req.model, choices=[],
                            usage=choices.usage()).dump())
        yield DONE

    def chat_chunk(self, c: int, delta: DeltaMessage, logprobs: list[ChatLogprob] | None = None,
                   **end) -> str:
        """A chunk of chat choice c: a delta, its tokens' logprobs, or the choice's `end` (finish and stop
        reasons)."""
        tokens = self.choices.to_send(c, bool(end)) if delta.role is MISSING else {}  # (not in the role's chunk)
        choice = ChatChunkChoice(index=c, delta=delta, logprobs=None if logprobs is None else ChatLogprobs(
            content=logprobs), **end, **tokens)
        chunk = ChatCompletionChunk(id=self.answer_id, created=self.created, model=self.req.model, choices=[choice],
                                    weight_version=self.choices.weight_version, **self._usage(c))
        if self.first_of(c):  # vLLM's return_token_ids: the prompt's in each choice's first chunk
            chunk.prompt_token_ids = self.req.prompts[c // self.req.params.n]
        return sse(chunk.dump())

    def completion_chunk(self, c: int, text: str = "", logprobs: CompletionLogprobs | None = None, **end) -> str:
        """A chunk of completion choice c: text, its tokens' logprobs, or the choice's `end`."""
        choice = CompletionChunkChoice(index=c, text=text, logprobs=logprobs, **end,
                                       **self.choices.to_send(c, bool(end)))
        if self.first_of(c):
            choice.prompt_token_ids = self.req.prompts[c // self.req.params.n]
        return sse(CompletionChunk(id=self.answer_id, created=self.created, model=self.req.model, choices=[choice],
                                   weight_version=self.choices.weight_version, **self._usage(c)).dump())

    def first_of(self, c: int) -> bool:
        """Whether this is choice c's first chunk, where token ids are asked for."""
        first = self.req.return_token_ids and not self.prompt_ids_sent[c]
        self.prompt_ids_sent[c] = True
        return first

    def _usage(self, c: int) -> dict:
        """The chunk's usage: choice c's so far (vLLM's continuous_usage_stats), or null until the last
        chunk where usage is asked for, or none."""
        if self.req.continuous_usage:
            return {"usage": self.choices.choice_usage(c)}
        return {"usage": None} if self.req.include_usage else {}
