"""vLLM's `LLMEngine` (`LLM.llm_engine`): requests added one at a time and stepped by the caller, each
step returning the `RequestOutput`s of the requests it moved, as each request's `output_kind` asks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxserve.config.lora import LoRARequest
from jaxserve.engine.inputs import PromptType, tokenize_prompt
from jaxserve.engine.outputs import OutputCollector, RequestOutput
from jaxserve.engine.request_metrics import RequestTimer
from jaxserve.sample.params import RequestOutputKind, SamplingParams


class EngineArgs:
    """vLLM's: the engine's options for `LLMEngine.from_engine_args`, as `LLM(model, **options)` takes them."""

    def __init__(self, model: str | None = None, **options):
        self.model, self.options = model, options


class LLMEngine:
    """The engine of an `LLM`, driven a step at a time (vLLM's `add_request` / `step` loop). Outputs
    follow `SamplingParams.output_kind`: CUMULATIVE (the default) everything so far at each step that
    moved the request, DELTA what is new, FINAL_ONLY the finished output alone."""

    def __init__(self, llm):
        self._llm = llm
        self._requests: dict[str, OutputCollector] = {}
        self._timers: dict[str, RequestTimer] = {}  # (`LLM.get_metrics`' request figures)
        self._sent: dict[str, list[tuple[int, int]]] = {}  # DELTA: (characters, tokens) of each choice sent

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        from jaxserve.llm import LLM
        return LLM(engine_args.model, **engine_args.options).llm_engine

    def get_tokenizer(self):
        return self._llm.get_tokenizer()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Queue a prompt (as `LLM.generate` takes one) under the caller's `request_id`; ValueError for
        an id in use or a prompt the engine refuses. `arrival_time` is accepted for vLLM's signature."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError("LLMEngine.add_request takes SamplingParams (embeddings: LLM.embed)")
        llm = self._llm
        llm.check_awake()
        text, ids = tokenize_prompt(prompt, llm.tokenizer)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        replica = llm._router.choose(ids, salt, [len(e.scheduler.seqs) for e in llm.engines])
        seq = llm.engines[replica].add_request(request_id, ids, params, priority=priority, cache_salt=salt,
                                               lora_request=lora_request)
        self._requests[request_id] = OutputCollector(request_id, text, seq.prompt_token_ids, params, lora_request)
        self._sent[request_id] = [(0, 0)] * params.n
        self._timers[request_id] = llm._request_metrics.timer(params.n, params.max_tokens)

    def step(self) -> list[RequestOutput]:
        """One step of each replica with requests -> the outputs of the requests it moved."""
        moved: dict[str, None] = {}
        for engine in self._llm.engines:
            if engine.has_unfinished():
                for update in engine.step():
                    if (collector := self._requests.get(update.request_id)) is not None:  # (else aborted)
                        collector.add(update)
                        self._timers[update.request_id].observe(update)
                        moved[update.request_id] = None
        return [out for request_id in moved if (out := self._output(request_id)) is not None]

    def _output(self, request_id: str) -> RequestOutput | None:
        collector = self._requests[request_id]
        kind = collector.params.output_kind
        if any(c.last is None for c in collector.choices) or (kind == RequestOutputKind.FINAL_ONLY
                                                              and not collector.finished):
            return None  # (a choice not forked yet; or not finished)
        out = collector.output(self._llm.tokenizer)
        if kind == RequestOutputKind.DELTA:
            out = self._delta(request_id, out)
        if collector.finished:
            self._forget(request_id)
        return out

    def _forget(self, request_id: str) -> None:
        del self._requests[request_id], self._sent[request_id]
        self._timers.pop(request_id).close()

    def _delta(self, request_id: str, out: RequestOutput) -> RequestOutput:
        sent = self._sent[request_id]
        self._sent[request_id] = [(len(c.text), len(c.token_ids)) for c in out.outputs]
        outputs = [dataclasses.replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                                       logprobs=None if c.logprobs is None else c.logprobs[tokens:],
                                       entropies=None if c.entropies is None else c.entropies[tokens:])
                   for c, (chars, tokens) in zip(out.outputs, sent)]
        first = all(tokens == 0 for _, tokens in sent)
        return dataclasses.replace(out, outputs=outputs, prompt_logprobs=out.prompt_logprobs if first else None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End the requests now (unknown or finished ids are ignored, as vLLM's); no output follows."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if request_id in self._requests:
                self._forget(request_id)
                for engine in self._llm.engines:
                    engine.abort(request_id)
