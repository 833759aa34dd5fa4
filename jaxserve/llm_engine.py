"""vLLM's `LLMEngine` (`LLM.llm_engine`): the offline engines (one per data-parallel replica), their
tokenizer and request figures, under which `LLM` runs; requests added one at a time and stepped by the
caller, each step returning the `RequestOutput`s of the requests it moved, as each request's
`output_kind` asks."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import jax
from prometheus_client import CollectorRegistry
from tqdm import tqdm

from checkpoints import DEFAULT_MODEL_NAME
from jaxserve.config.engine import EngineConfig
from jaxserve.config.engine_args import EngineArgs, engine_config
from jaxserve.config.lora import LoRARequest
from jaxserve.config.plugins import import_class
from jaxserve.engine.build import build_engines
from jaxserve.engine.core import Engine
from jaxserve.engine.inputs import PromptType, Tokenization, tokenize_prompt
from jaxserve.engine.pooling import PoolingParams
from jaxserve.engine.outputs import OutputCollector, RequestOutput, Update
from jaxserve.engine.pausing import PAUSE_MODES, SLEEP_LEVELS
from jaxserve.engine.replicas import Router
from jaxserve.engine.request_metrics import RequestMetrics, RequestTimer
from jaxserve.engine.workers import Worker
from jaxserve.errors import StepFailed
from jaxserve.sample.params import RequestOutputKind, SamplingParams


class LLMEngine:
    """The engine of an `LLM`, driven a step at a time (vLLM's `add_request` / `step` loop). Outputs
    follow `SamplingParams.output_kind`: CUMULATIVE (the default) everything so far at each step that
    moved the request, DELTA what is new, FINAL_ONLY the finished output alone; with n > 1, as vLLM's,
    the first two give one output per choice that moved (its `outputs` that choice alone), the last
    one output of every choice."""

    def __init__(self, config: EngineConfig, worker_extension_cls: str | None = None):
        """`worker_extension_cls`: vLLM's, "module.Class" whose methods `collective_rpc` calls by name
        on each replica's `Worker`."""
        if jax.process_count() > 1:
            raise RuntimeError("the offline LLM API runs in one process; serve a multi-host mesh with run_server.py")
        if config.data_parallel_backend != "thread":
            raise ValueError("the offline LLM runs its data-parallel replicas in threads (data_parallel_backend="
                             "'thread'); replicas on Ray serve through run_server.py")
        self.engines, self.tokenizer = build_engines(config)
        self.engine = self.engines[0]  # (what the replicas share: the model, the configuration)
        self.router = Router.for_config(len(self.engines), self.engine.config)
        self.registry = CollectorRegistry()
        self.request_metrics = RequestMetrics(self.registry, config.model or DEFAULT_MODEL_NAME, config.max_model_len)
        self._requests: dict[str, OutputCollector] = {}
        self._timers: dict[str, RequestTimer] = {}  # (`LLM.get_metrics`' request figures)
        self._sent: dict[tuple[str, int], tuple[int, int]] = {}  # DELTA: (characters, tokens) of a choice sent
        self._prompt_sent: set[str] = set()  # DELTA: the requests whose prompt logprobs went out
        self._released: list[Update] = []  # (a step finished by new weights or sleep, outside `step`)
        self.paused = False  # `sleep` (any level) until `wake_up`
        self.batch = Batch(self)  # (`LLM.generate`'s and `LLM.enqueue`'s requests)
        extension = () if worker_extension_cls is None else (import_class(worker_extension_cls, "worker_extension_cls"),)
        worker = type("Worker", (*extension, Worker), {})
        self.workers = [worker(engine) for engine in self.engines]

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        options = {name: value for name, value in vars(engine_args).items() if name != "model"}
        extension = options.pop("worker_extension_cls", None)
        return cls(engine_config(engine_args.model, **options), extension)

    def get_tokenizer(self):
        """The Hugging Face tokenizer of the model; ValueError without one (skip_tokenizer_init), as vLLM's."""
        if self.tokenizer is None:
            raise ValueError("Unable to get tokenizer because skip_tokenizer_init=True")
        return self.tokenizer.hf

    def check_generates(self) -> None:
        """ValueError for an embedding model; RuntimeError while asleep."""
        if self.engine.config.runner == "pooling":
            raise ValueError("this LLM runs an embedding model (runner=\"pooling\"): use LLM.embed")
        self.check_awake()

    def check_awake(self) -> None:
        if self.is_sleeping():
            raise RuntimeError("the LLM is asleep (sleep: paused, its KV cache or weights freed): call wake_up first")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    tokenization_kwargs: dict | None = None, trace_headers: dict | None = None,
                    priority: int = 0) -> None:
        """Queue a prompt (as `LLM.generate` takes one, tokenized as `tokenization_kwargs` say) under
        the caller's `request_id`; ValueError for an id in use or a prompt the engine refuses.
        `arrival_time` is taken for vLLM's signature (the request's figures start when it is added)."""
        self.check_generates()
        self.check_no_batch()
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        if not isinstance(params, SamplingParams):
            raise ValueError("LLMEngine.add_request takes SamplingParams (embeddings: LLM.embed)")
        if trace_headers:
            raise ValueError("trace_headers: jaxserve exports no OpenTelemetry traces")
        check_lora_request(lora_request)
        tokenization = Tokenization.of(tokenization_kwargs, self.engine.config.max_model_len)
        loads = [len(e.scheduler.seqs) for e in self.engines]
        _, self._requests[request_id], self._timers[request_id] = self.admit(request_id, prompt, params, priority,
                                                                             lora_request, tokenization, loads)

    def admit(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, priority: int,
              lora: LoRARequest | None, tokenization: Tokenization,
              loads: list[int]) -> tuple[Engine, OutputCollector, RequestTimer]:
        """Add a request to the replica the router picks (`loads`: each one's requests) -> that replica,
        the request's collector and its timer."""
        text, ids = tokenize_prompt(prompt, self.tokenizer, tokenization)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        engine = self.engines[self.router.choose(ids, salt, loads)]
        seq = engine.add_request(request_id, ids, params, priority=priority, cache_salt=salt, lora_request=lora)
        return (engine, OutputCollector(request_id, text, seq.prompt_token_ids, params, lora),
                self.request_metrics.timer(params.n, params.max_tokens))

    def check_no_batch(self) -> None:
        if self.batch.collectors:
            raise RuntimeError("requests of LLM.enqueue are waiting: run them with LLM.wait_for_completion first")

    def step(self) -> list[RequestOutput]:
        """One step of each replica with requests -> the outputs of the requests it moved. Where a step
        fails, its requests end (StepFailed, raised after the other replicas' steps)."""
        self.check_no_batch()
        self.check_awake()
        updates, self._released, failed = self._released, [], None
        for engine in self.engines:
            try:
                if engine.has_unfinished():
                    updates += engine.step()
            except StepFailed as e:
                failed = e
                self.failed(e)
        outputs = self._outputs(updates)
        if failed is not None:
            raise failed
        return outputs

    def failed(self, e: StepFailed) -> None:
        """A step failed: its requests have ended."""
        for request_id in e.request_ids:
            if request_id in self._requests:
                self._forget(request_id)

    def _outputs(self, updates: list[Update]) -> list[RequestOutput]:
        moved: dict[str, dict[int, None]] = {}
        for update in updates:
            if (collector := self._requests.get(update.request_id)) is not None:  # (else aborted)
                collector.add(update)
                self._timers[update.request_id].observe(update)
                moved.setdefault(update.request_id, {})[update.index] = None
        outputs = []
        for request_id, indices in moved.items():
            collector = self._requests[request_id]
            kind = collector.params.output_kind
            if kind == RequestOutputKind.FINAL_ONLY:
                outputs += [collector.output(self.tokenizer)] if collector.finished else []
            else:
                outputs += [self._delta(request_id, collector.output(self.tokenizer, [i]))
                            if kind == RequestOutputKind.DELTA else collector.output(self.tokenizer, [i])
                            for i in indices]
            if collector.finished:
                self._forget(request_id)
        return outputs

    def _delta(self, request_id: str, out: RequestOutput) -> RequestOutput:
        """A choice's output as what is new since its last (the prompt's logprobs in the first alone)."""
        (c,) = out.outputs
        chars, tokens = self._sent.get((request_id, c.index), (0, 0))
        self._sent[request_id, c.index] = len(c.text), len(c.token_ids)
        new = dataclasses.replace(c, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                                  logprobs=None if c.logprobs is None else c.logprobs[tokens:],
                                  entropies=None if c.entropies is None else c.entropies[tokens:])
        first = request_id not in self._prompt_sent
        self._prompt_sent.add(request_id)
        return dataclasses.replace(out, outputs=[new], prompt_logprobs=out.prompt_logprobs if first else None)

    def _forget(self, request_id: str) -> None:
        del self._requests[request_id]
        self._timers.pop(request_id).close()
        self._prompt_sent.discard(request_id)
        for key in [key for key in self._sent if key[0] == request_id]:
            del self._sent[key]

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: call `method` on every replica's `Worker` at once (a thread each) -> their results, in
        replica order: a callable (given the worker, then `args` and `kwargs`), or the name of a method
        of `worker_extension_cls`. TimeoutError past `timeout` seconds (the calls go on)."""
        if not callable(method):
            if not callable(getattr(type(self.workers[0]), method, None)) or hasattr(Worker, method):
                raise ValueError(f"collective_rpc({method!r}): no such method of worker_extension_cls (jaxserve's "
                                 "workers have none of vLLM's; pass a callable, or a class of your own as "
                                 "worker_extension_cls)")
            method = getattr(type(self.workers[0]), method)
        pool = ThreadPoolExecutor(len(self.workers), thread_name_prefix="collective-rpc")
        try:
            calls = [pool.submit(method, worker, *args, **(kwargs or {})) for worker in self.workers]
            deadline = None if timeout is None else time.monotonic() + timeout
            return [call.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for call in calls]
        finally:
            pool.shutdown(wait=False)  # (past the timeout, the calls go on without the caller)

    def apply_model(self, func: Callable) -> list:
        """vLLM's: `func(model)` for each replica -> the results, where `model` is the replica's Flax
        NNX module with the weights it runs (new weights reach the engine by `update_weights`)."""
        return self.collective_rpc(lambda worker: func(worker.model()))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End the requests now (unknown or finished ids are ignored, as vLLM's); no output follows."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if request_id in self._requests:
                self._forget(request_id)
                for engine in self.engines:
                    engine.abort(request_id)

    # --- LoRA adapters (vLLM's): read into each replica's host memory, up to max_cpu_loras ---

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read the adapter now (ValueError where the engine cannot serve it), for the requests naming it."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora takes a jaxserve.LoRARequest, got {type(lora_request).__name__}")
        for engine in self.engines:
            engine.check_adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter (a request naming it reads it again) -> whether it was held."""
        return any([engine.adapter_store().remove(lora_id) for engine in self.engines])

    def list_loras(self) -> set[int]:
        return set().union(*(engine.adapter_store().held() for engine in self.engines))

    def pin_lora(self, lora_id: int) -> bool:
        """Keep the adapter in host memory past max_cpu_loras (the device's slots stay least recently
        used first: a slot it leaves is refilled from host memory, not its files)."""
        for engine in self.engines:
            engine.adapter_store().pin(lora_id)
        return True

    # --- sleep mode (vLLM's), the prefix cache: between two steps ---

    def is_sleeping(self) -> bool:
        """Paused (`sleep`, any level) or memory freed: nothing steps until `wake_up`."""
        return self.paused or self._memory_freed()

    def _memory_freed(self) -> bool:
        return any(engine.is_sleeping for engine in self.engines)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: level 0 pauses (`generate` and `step` refuse until `wake_up`), 1 also frees the KV
        cache and keeps the weights on the host, 2 frees both. `mode`: the requests not finished end
        ("abort": no output follows) or wait to go on once awake ("keep"; from level 1 they recompute
        their KV); "wait" takes none (nothing in this process would run them while sleep waits)."""
        if level not in SLEEP_LEVELS or mode not in PAUSE_MODES:
            raise ValueError(f"sleep takes a level of {list(SLEEP_LEVELS)} and a mode of {list(PAUSE_MODES)}, "
                             f"not {level!r} and {mode!r}")
        pending = [*self._requests, *self.batch.collectors]
        if mode == "wait" and pending:
            raise ValueError(f"sleep(mode='wait'): nothing runs the {len(pending)} unfinished requests while it waits; "
                             "finish them first (step, wait_for_completion), or sleep with mode 'abort' or 'keep'")
        if mode == "abort":
            self.abort_request(list(self._requests))
            self.batch.abort(list(self.batch.collectors))
        if level >= 1:
            self.between_steps(lambda i, engine: engine.sleep(level))
        self.paused = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: restore what `sleep` freed (`tags` "weights", "kv_cache"; default all), compiling
        nothing; once all is awake, the pause ends ("scheduling" alone ends a level 0 one) -> whether
        it has."""
        for engine in self.engines:
            engine.wake_up(tags)
        self.paused = self.paused and self._memory_freed()
        return not self.is_sleeping()

    def release_kv_cache_memory(self) -> None:
        """vLLM's: after `sleep(level=0)`, free the KV cache (kept requests recompute theirs) until woken."""
        if not self.paused or self._memory_freed():
            raise RuntimeError("release_kv_cache_memory needs sleep(level=0) first, and no memory freed yet")
        self.between_steps(lambda i, engine: engine.release_kv_cache())

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget the prefix cache's pages (of every replica); False, forgetting nothing, while
        requests run, unless `reset_running_requests` (they drop their KV first, to recompute it). No
        KV connector here: `reset_connector` has nothing more to reset."""
        if reset_running_requests:
            self.between_steps(lambda i, engine: engine.preempt_running())
        elif any(engine.has_unfinished() for engine in self.engines):
            return False
        return all([engine.scheduler.allocator.reset_prefix_cache() for engine in self.engines])

    def between_steps(self, act: Callable[[int, Engine], list[Update]]) -> None:
        """`act(i, engine)` for each replica, which finishes its step in flight first: what that released,
        the next `step` returns (its requests may be running)."""
        for i, engine in enumerate(self.engines):
            try:
                self._released += act(i, engine)
            except StepFailed as e:
                self.failed(e)
                raise


class Batch:
    """The requests of `LLM.generate` and `LLM.enqueue`: added to the replicas (each to the one the
    router picks), then run to their end together (`run`), their outputs in the order they were added."""

    def __init__(self, llm_engine: LLMEngine):
        self.llm_engine = llm_engine
        self.collectors: dict[str, OutputCollector] = {}
        self.timers: dict[str, RequestTimer] = {}
        self.replica: dict[str, Engine] = {}
        self.loads = [0] * len(llm_engine.engines)  # (the requests of this batch each replica runs)

    def add(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams, priority: int,
            lora: LoRARequest | None, tokenization: Tokenization) -> None:
        engine, self.collectors[request_id], self.timers[request_id] = self.llm_engine.admit(
            request_id, prompt, params, priority, lora, tokenization, self.loads)
        self.loads[self.llm_engine.engines.index(engine)] += 1
        self.replica[request_id] = engine

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in list(request_ids):
            self.replica.pop(request_id).abort(request_id)
            del self.collectors[request_id]
            self.timers.pop(request_id).close()

    def run(self, use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        """Step the replicas until every request of the batch has finished; the batch is then empty. A
        failure (a step's, Ctrl-C) ends all of its requests."""
        self.llm_engine.batch = Batch(self.llm_engine)
        try:
            with progress_bar(use_tqdm, total=len(self.collectors), desc="generating") as bar:
                _run([e for e in self.llm_engine.engines if e.has_unfinished()], self.collectors, self.timers, bar)
        except BaseException:
            for request_id, engine in self.replica.items():
                engine.abort(request_id)
            raise
        finally:
            for timer in self.timers.values():
                timer.close()
        return [c.output(self.llm_engine.tokenizer) for c in self.collectors.values()]


def progress_bar(use_tqdm, **options) -> tqdm:
    """vLLM's `use_tqdm`: a bool (tqdm's bar, or none), or what makes the bar (a tqdm class or function)."""
    return use_tqdm(**options) if callable(use_tqdm) else tqdm(**options, disable=not use_tqdm)


def _run(engines: list[Engine], collectors: dict[str, OutputCollector], timers: dict[str, RequestTimer],
         bar: tqdm) -> None:
    """Step the engines until their requests finish: each data-parallel replica in a thread of its own
    (a step waits for its devices without the GIL), one alone in this one. A failure (or Ctrl-C)
    stops them all after their step in flight."""
    stop = threading.Event()

    def run(engine: Engine) -> None:
        while engine.has_unfinished() and not stop.is_set():
            for update in engine.step():
                collectors[update.request_id].add(update)
                timers[update.request_id].observe(update)
            if len(engines) == 1:
                bar.update(sum(c.finished for c in collectors.values()) - bar.n)

    if len(engines) <= 1:
        return run(engines[0]) if engines else None
    with ThreadPoolExecutor(len(engines), thread_name_prefix="replica") as pool:
        running = [pool.submit(run, engine) for engine in engines]
        try:
            while not all(f.done() for f in running) and not any(f.done() and f.exception() for f in running):
                wait(running, timeout=0.2, return_when=FIRST_EXCEPTION)
                bar.update(sum(c.finished for c in collectors.values()) - bar.n)
        finally:
            stop.set()
    for f in running:
        f.result()  # (a step's exception, raised here)


def check_lora_request(lora: object) -> None:
    if lora is not None and not isinstance(lora, LoRARequest):
        raise ValueError(f"lora_request takes jaxserve.LoRARequest (or None), got {type(lora).__name__}")
