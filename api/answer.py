"""The answer to a chat or completions request: the whole response, or a stream of server-sent
chunks ended by `data: [DONE]`. When the client goes away Quart cancels the stream, which aborts
the request's sequences (their pages are freed at the next step)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from quart import Response

from api.choices import Choices
from api.generation import admit, generation, stream_error_status
from api.protocol import APIError, GenerationRequest
from api.sse import DONE, now, sse
from api.state import APIState


async def answer(state: APIState, req: GenerationRequest, request_id: str, chat: bool) -> Response | dict:
    admit(state, req, chat)
    head = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": now(),
            "model": req.model}
    if req.stream:
        chunks = ChunkStream(state, req, request_id, chat, head)
        return Response(chunks.events(), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = Choices(req, chat, state.engine, state.tool_parser)
    try:
        async for i, update in generation(state, req, request_id):
            choices.add(choices.choice_index(i, update), update)
    except ValueError as e:
        raise APIError(str(e)) from e
    return choices.body(head)


class ChunkStream:
    """The chunks of one streamed chat or completions answer."""

    def __init__(self, state: APIState, req: GenerationRequest, request_id: str, chat: bool, head: dict):
        self.state, self.req, self.request_id, self.chat = state, req, request_id, chat
        self.head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        self.extra = {"usage": None} if req.include_usage else {}
        self.choices = Choices(req, chat, state.engine, state.tool_parser)
        self.prompt_ids_sent = [False] * len(self.choices.texts)

    async def events(self) -> AsyncIterator[str]:
        req, choices = self.req, self.choices
        for c in range(len(choices.texts)) if self.chat else ():
            yield self.chunk(c, {"role": req.role, "content": ""})
        try:
            async for i, update in generation(self.state, req, self.request_id):
                c = choices.choice_index(i, update)
                text, logprobs = choices.add(c, update)
                if self.chat:
                    # a token whose text is held back still brings its logprobs (with no content, as vLLM's)
                    ds = choices.deltas(c, text, update.finish_reason is not None) or (
                        [{"content": ""}] if logprobs else [])
                    for k, delta in enumerate(ds):
                        yield self.chunk(c, delta, logprobs=logprobs if k == 0 else None)
                elif text or (logprobs and logprobs["tokens"]):
                    yield self.chunk(c, text=text, logprobs=logprobs)
                if update.finish_reason is not None:
                    yield self.chunk(c, finish_reason=choices.finish_reason(c), stop_reason=update.stop_reason)
        except Exception as e:  # after the 200 is sent, an error can only be an event in the stream
            yield sse(APIError(str(e), status=stream_error_status(self.state, e)).body())
        if req.include_usage:
            yield sse({**self.head, "choices": [], "usage": choices.usage()})
        yield DONE

    def chunk(self, c: int, delta: dict | None = None, text: str | None = None, logprobs=None,
              finish_reason: str | None = None, stop_reason=None) -> str:
        if self.chat:
            choice = {"index": c, "delta": delta or {},
                      "logprobs": None if logprobs is None else {"content": logprobs}}
        else:
            choice = {"index": c, "text": text or "", "logprobs": logprobs}
        choice.update(finish_reason=finish_reason, stop_reason=stop_reason)
        if delta is None or "role" not in delta:
            choice.update(self.choices.ids_to_send(c))
        prompt_ids = {}  # vLLM's return_token_ids: the prompt's in each choice's first chunk
        if self.req.return_token_ids and not self.prompt_ids_sent[c]:
            self.prompt_ids_sent[c] = True
            prompt_ids = {"prompt_token_ids": self.req.prompts[c // self.req.params.n]}
        if not self.chat:
            choice, prompt_ids = {**choice, **prompt_ids}, {}
        if self.req.continuous_usage:
            return sse({**self.head, **prompt_ids, "choices": [choice], "usage": self.choices.choice_usage(c)})
        return sse({**self.head, **prompt_ids, "choices": [choice], **self.extra})
