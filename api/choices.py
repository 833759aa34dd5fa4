"""A request's choices as the API answers them: each choice's text, logprobs, token ids, tool calls
and reasoning gathered for the whole answer or cut into stream chunks (`Choices`)."""

from __future__ import annotations

from api.logprobs import CompletionLogprobsWriter, chat_logprobs, prompt_logprobs
from api.protocol import GenerationRequest
from api.reasoning import ChoiceReasoning, split_reasoning
from api.response_models import (ChatChoice, ChatCompletion, ChatLogprob, ChatLogprobs, ChatMessage, Completion,
                                 CompletionChoice, CompletionLogprobs, DeltaMessage, HiddenStatesOut, PromptLogprobs,
                                 Usage)
from api.tool_parsers import ToolParser
from api.tools import ChoiceTools
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.outputs import HiddenStates, Update
from jaxserve.sample.residual import encode_array


def hidden_states_out(hidden: HiddenStates, encoding: str) -> HiddenStatesOut:
    data = encode_array(hidden.data) if encoding == "base64" else hidden.data.tolist()
    return HiddenStatesOut(layers=hidden.layers, positions=hidden.positions, shape=list(hidden.data.shape),
                           encoding=encoding, data=data)


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
        self.entropies: list[list[float]] = [[] for _ in range(count)]  # each choice's, for return_entropy
        self.unsent = [0] * count  # how many of their tokens no chunk has carried yet
        # each choice's hidden states (return_hidden_states), once it finished
        self.hidden: list[HiddenStatesOut | None] = [None] * count
        self.weight_version = 0  # the newest weights any of the tokens so far was sampled under
        offset = [len(req.prompt_texts[c // n]) if req.echo else 0 for c in range(count)]
        self.completion_logprobs = [CompletionLogprobsWriter(self.tokenizer, offset[c], req.tokens_as_ids)
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

    def add(self, c: int, update: Update) -> tuple[str, CompletionLogprobs | list[ChatLogprob] | None]:
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
        self.weight_version = max(self.weight_version, update.weight_version)
        text, token_ids, logprobs, entropies = update.text, update.token_ids, update.logprobs, update.entropies
        if self.req.prompt_only:
            text, token_ids, logprobs, entropies = "", [], [], []
        else:
            self.tokens[c] = update.num_output_tokens
        self.token_ids[c] += token_ids
        self.entropies[c] += entropies
        if update.hidden_states is not None:
            self.hidden[c] = hidden_states_out(update.hidden_states, self.req.params.return_hidden_states.encoding)
        self.unsent[c] += len(token_ids)
        parts = []
        if first and self.req.echo:
            text = self.req.prompt_texts[p] + text
            if self.req.params.logprobs is not None:
                ids = self.req.prompts[p]
                k = self.req.params.logprobs  # (prompt_logprobs may ask for more alternatives)
                prompt = [lp._replace(top_ids=lp.top_ids[:k], top_logprobs=lp.top_logprobs[:k])
                          for lp in update.prompt_logprobs]
                parts.append(CompletionLogprobsWriter(self.tokenizer, as_ids=self.req.tokens_as_ids).format(
                    ids, [None, *prompt]))
        self.texts[c].append(text)
        if self.req.params.logprobs is None:
            return text, None
        if self.chat:
            part = chat_logprobs(self.tokenizer, token_ids, logprobs, self.req.tokens_as_ids)
        else:
            part = CompletionLogprobs.merged([*parts, self.completion_logprobs[c].format(token_ids, logprobs)])
        self.logprobs[c].append(part)
        return text, part

    def deltas(self, c: int, text: str, finished: bool) -> list[DeltaMessage]:
        """The chat deltas of text that choice c adds (`add`'s): its reasoning apart (--reasoning-parser),
        then content, or tool calls where asked for."""
        out = []
        if self.reasoning is not None:
            reasoning, text = self.reasoning[c].feed(text)
            if finished:
                more_reasoning, more_text = self.reasoning[c].finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                out.append(DeltaMessage(reasoning=reasoning, reasoning_content=reasoning))  # (vLLM's older name)
        if self.tools is None:
            return out + ([DeltaMessage(content=text)] if text else [])
        cut = finished and self.finish[c] == "length"
        out += self.tools[c].feed(text, cut)
        return out + self.tools[c].finish(cut) if finished else out

    def to_send(self, c: int, end: bool = False) -> dict:
        """In a stream, what the next chunk of choice c carries of its tokens that no chunk has carried
        yet (whose text may have come earlier or be held back): their ids (vLLM's return_token_ids),
        their entropies (return_entropy), as the chunk choice's fields; and in its `end` chunk (the
        finish reason's), its hidden states (return_hidden_states)."""
        n, self.unsent[c] = self.unsent[c], 0
        out = {}
        if self.req.return_token_ids:
            out["token_ids"] = self.token_ids[c][len(self.token_ids[c]) - n:]
        if self.req.params.return_entropy:
            out["entropies"] = self.entropies[c][len(self.entropies[c]) - n:]
        if end and self.hidden[c] is not None:
            out["hidden_states"] = self.hidden[c]
        return out

    def usage(self) -> Usage:
        return Usage.of(sum(map(len, self.req.prompts)), sum(self.tokens), sum(self.cached))

    def choice_usage(self, c: int) -> Usage:
        """Choice c's own usage so far (vLLM's continuous_usage_stats)."""
        p = c // self.n
        return Usage.of(len(self.req.prompts[p]), self.tokens[c], self.cached[p])

    def chat_completion(self, request_id: str, created: int) -> ChatCompletion:
        extra = {}
        if self.req.params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.vllm_prompt_logprobs(0)
        if self.req.return_token_ids:
            extra["prompt_token_ids"] = self.req.prompts[0]
        return ChatCompletion(id=request_id, created=created, model=self.req.model, usage=self.usage(), **extra,
                              weight_version=self.weight_version,
                              choices=[self._chat_choice(c, "".join(parts)) for c, parts in enumerate(self.texts)])

    def _chat_choice(self, c: int, text: str) -> ChatChoice:
        logprobs = None
        if self.req.params.logprobs is not None:
            logprobs = ChatLogprobs(content=[entry for part in self.logprobs[c] for entry in part])
        think = None
        if self.reasoning is not None:
            think, content = split_reasoning(self.req.thinking, text)
            text = content or ""
        if self.tools is not None:
            message = self.tools[c].message(text, cut=self.finish[c] == "length")
            message.role = self.req.role
        else:
            message = ChatMessage(role=self.req.role, content=text)
        if self.reasoning is not None:
            message.reasoning = message.reasoning_content = think
            if message.content == "":
                message.content = None  # (vLLM's, with a reasoning parser: no answer is None)
        extra = {"token_ids": self.token_ids[c]} if self.req.return_token_ids else {}
        if self.req.params.return_entropy:
            extra["entropies"] = self.entropies[c]
        if self.hidden[c] is not None:
            extra["hidden_states"] = self.hidden[c]
        return ChatChoice(index=c, message=message, logprobs=logprobs, finish_reason=self.finish_reason(c),
                          stop_reason=self.stop_reason[c], **extra)

    def completion(self, request_id: str, created: int) -> Completion:
        return Completion(id=request_id, created=created, model=self.req.model, usage=self.usage(),
                          weight_version=self.weight_version,
                          choices=[self._completion_choice(c, "".join(parts)) for c, parts in enumerate(self.texts)])

    def _completion_choice(self, c: int, text: str) -> CompletionChoice:
        logprobs = None if self.req.params.logprobs is None else CompletionLogprobs.merged(self.logprobs[c])
        extra = {}
        if self.req.return_token_ids:
            extra.update(token_ids=self.token_ids[c], prompt_token_ids=self.req.prompts[c // self.n])
        if self.req.params.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.vllm_prompt_logprobs(c // self.n)
        if self.req.params.return_entropy:
            extra["entropies"] = self.entropies[c]
        if self.hidden[c] is not None:
            extra["hidden_states"] = self.hidden[c]
        return CompletionChoice(index=c, text=text, logprobs=logprobs, finish_reason=self.finish_reason(c),
                                stop_reason=self.stop_reason[c], **extra)

    def vllm_prompt_logprobs(self, p: int) -> PromptLogprobs:
        return prompt_logprobs(self.tokenizer, self.req.prompts[p], self.prompt_logprobs[p] or [])
