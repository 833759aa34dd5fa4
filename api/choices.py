"""A request's choices as the API answers them: the updates of its sequences merged as they come
(`merged`), and each choice's text, logprobs, token ids, tool calls and reasoning gathered for the
whole answer or cut into stream chunks (`Choices`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from api.protocol import GenerationRequest
from api.reasoning import ChoiceReasoning, split_reasoning
from api.responses import CompletionLogprobs, chat_logprobs, merge_completion_logprobs, prompt_logprobs, usage
from api.tool_parsers import ToolParser
from api.tools import ChoiceTools
from jaxserve.async_engine import AsyncEngine, Update


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


class Choices:
    """Accumulates the choices of one request (non-streaming) and counts tokens (both)."""

    def __init__(self, req: GenerationRequest, chat: bool, engine: AsyncEngine, tool_parser: ToolParser):
        n = req.params.n
        self.req, self.chat, self.n = req, chat, n
        self.tokenizer = engine.tokenizer
        count = len(req.prompts) * n
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.finish: list[str | None] = [None] * count
        self.stop_reason: list[int | str | None] = [None] * count
        self.tokens = [0] * count
        self.cached = [0] * len(req.prompts)  # prompt tokens served from the prefix cache, per prompt
        self.prompt_logprobs: list[list | None] = [None] * len(req.prompts)  # per prompt, when asked for
        self.logprobs: list[list] = [[] for _ in range(count)]
        self.token_ids: list[list[int]] = [[] for _ in range(count)]  # each choice's, for return_token_ids
        self.unsent_ids = [0] * count  # how many of them no chunk has carried yet
        offset = [len(req.prompt_texts[c // n]) if req.echo else 0 for c in range(count)]
        self.completion_logprobs = [CompletionLogprobs(self.tokenizer, offset[c], req.tokens_as_ids)
                                    for c in range(count)]
        self.tools = [ChoiceTools(req.tools, tool_parser) for _ in range(count)] if req.tools else None
        # --reasoning-parser (chat): the thinking apart from the content
        thinking = req.thinking if chat else None
        self.reasoning = None if thinking is None else [ChoiceReasoning(thinking) for _ in range(count)]

    def finish_reason(self, c: int) -> str | None:
        """OpenAI's "tool_calls" (or legacy "function_call") where a choice that stopped made calls."""
        if self.tools is not None and self.tools[c].has_calls and self.finish[c] == "stop":
            return self.tools[c].finish_reason
        return self.finish[c]

    def choice_index(self, prompt: int, update: Update) -> int:
        return prompt * self.n + update.index

    def add(self, c: int, update: Update) -> tuple[str, dict | list | None]:
        """Record an update of choice c; -> the text it adds and its logprobs in the response's shape
        (None if not asked). A completion's first update brings the echoed prompt (and its logprobs);
        with `prompt_only`, nothing else."""
        p = c // self.n
        first = not self.texts[c]
        if update.index == 0:
            self.cached[p] = update.num_cached_tokens
        if update.prompt_logprobs is not None:
            self.prompt_logprobs[p] = update.prompt_logprobs
        self.finish[c], self.stop_reason[c] = update.finish_reason, update.stop_reason
        text, token_ids, logprobs = update.text, update.token_ids, update.logprobs
        if self.req.prompt_only:
            text, token_ids, logprobs = "", [], []
        else:
            self.tokens[c] = update.num_output_tokens
        self.token_ids[c] += token_ids
        self.unsent_ids[c] += len(token_ids)
        parts = []
        if first and self.req.echo:
            text = self.req.prompt_texts[p] + text
            if self.req.params.logprobs is not None:
                ids = self.req.prompts[p]
                k = self.req.params.logprobs  # (prompt_logprobs may ask for more alternatives)
                prompt = [lp._replace(top_ids=lp.top_ids[:k], top_logprobs=lp.top_logprobs[:k])
                          for lp in update.prompt_logprobs]
                parts.append(CompletionLogprobs(self.tokenizer, as_ids=self.req.tokens_as_ids).format(
                    ids, [None, *prompt]))
        self.texts[c].append(text)
        if self.req.params.logprobs is None:
            return text, None
        if self.chat:
            part = chat_logprobs(self.tokenizer, token_ids, logprobs, self.req.tokens_as_ids)
        else:
            part = merge_completion_logprobs([*parts, self.completion_logprobs[c].format(token_ids, logprobs)])
        self.logprobs[c].append(part)
        return text, part

    def deltas(self, c: int, text: str, finished: bool) -> list[dict]:
        """The chat deltas of text that choice c adds (`add`'s): its reasoning apart (--reasoning-parser),
        then content, or tool calls where asked for."""
        out = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning[c].feed(text)
            if finished:
                more_reasoning, more_text = self.reasoning[c].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                out.append({"reasoning": reasoning, "reasoning_content": reasoning})  # (vLLM's older name)
        if self.tools is None:
            return out + ([{"content": text}] if text else [])
        out += self.tools[c].feed(text)
        return out + self.tools[c].finish() if finished else out

    def ids_to_send(self, c: int) -> dict:
        """vLLM's return_token_ids in a stream: a chunk carries the token ids of choice c that no chunk
        has carried yet (whose text may have come earlier or be held back)."""
        if not self.req.return_token_ids:
            return {}
        ids = self.token_ids[c][len(self.token_ids[c]) - self.unsent_ids[c]:]
        self.unsent_ids[c] = 0
        return {"token_ids": ids}

    def usage(self) -> dict:
        return usage(sum(map(len, self.req.prompts)), sum(self.tokens), sum(self.cached))

    def choice_usage(self, c: int) -> dict:
        """Choice c's own usage so far (vLLM's continuous_usage_stats)."""
        p = c // self.n
        return usage(len(self.req.prompts[p]), self.tokens[c], self.cached[p])

    def body(self, head: dict) -> dict:
        choices = []
        for c, parts in enumerate(self.texts):
            text = "".join(parts)
            if self.req.params.logprobs is None:
                logprobs = None
            elif self.chat:
                logprobs = {"content": [entry for part in self.logprobs[c] for entry in part]}
            else:
                logprobs = merge_completion_logprobs(self.logprobs[c])
            reasoning = {}
            if self.reasoning is not None:
                think, content = split_reasoning(self.req.thinking, text)
                text, reasoning = content or "", {"reasoning": think, "reasoning_content": think}
            if not self.chat:
                body = {"text": text}
            elif self.tools is not None:
                body = {"message": {**self.tools[c].message(text), "role": self.req.role, **reasoning}}
            else:
                body = {"message": {"role": self.req.role, "content": text, **reasoning}}
            if reasoning and body["message"]["content"] == "":
                body["message"]["content"] = None  # (vLLM's, with a reasoning parser: no answer is None)
            choices.append({"index": c, **body, "logprobs": logprobs, "finish_reason": self.finish_reason(c),
                            "stop_reason": self.stop_reason[c]})
            if self.req.return_token_ids:
                choices[-1]["token_ids"] = self.token_ids[c]
                if not self.chat:
                    choices[-1]["prompt_token_ids"] = self.req.prompts[c // self.n]
            if not self.chat and self.req.params.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self.vllm_prompt_logprobs(c // self.n)
        extra = {}
        if self.chat and self.req.params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.vllm_prompt_logprobs(0)
        if self.chat and self.req.return_token_ids:
            extra["prompt_token_ids"] = self.req.prompts[0]
        return {**head, "choices": choices, "usage": self.usage(), **extra}

    def vllm_prompt_logprobs(self, p: int) -> list[dict | None]:
        return prompt_logprobs(self.tokenizer, self.req.prompts[p], self.prompt_logprobs[p] or [])
