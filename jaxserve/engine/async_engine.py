"""AsyncEngine: the engine loop in its own thread, and an async stream per request.

The API never blocks on the device. The thread first warms the engine up unless it was built
warm (`Engine.warmup`: the fewest step buckets that run every request, the rest in the
background), while the API already answers: its /health with 503 until `is_ready`. Coroutines
hand commands (add, abort) to the engine thread through a queue; the thread applies them between
steps (those sent during the warm-up once it ends), in the order sent, runs `Engine.step()` (which
also releases text; the requests sent while the step before computes may join the step planned
behind it, `_add_arrivals`), and posts each sequence's update onto the requester's asyncio queue with
`call_soon_threadsafe`. A request whose consumer goes away (client disconnect) is aborted, so its
pages are freed at the next step.

A trainer's controls (`CONTROLS`: pause, resume, new weights, sleep and wake) run on the engine
thread between steps too (a `Control` command). Paused, the loop steps no more; requests that
come meanwhile, or that ask for newer weights than the engine's (`min_weight_version`), are held
and added once it resumes, or once the weights are new enough.

The waiting queue may be bounded (`admission`, a `QueueBound`: the API refuses what would
overflow it, before any work). A step that raises ends only the requests it computed
(`StepFailed`); the loop stops (and the server with it) only when the engine cannot step: the KV
cache is lost, or a step failed without a request to blame (it would fail again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future

from jaxserve.config.lora import LoRARequest
from jaxserve.engine.admission import QueueBound
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams, round_params, search
from jaxserve.engine.commands import Abort, AbortAll, Add, Control, End, Subscriber
from jaxserve.engine.core import Engine
from jaxserve.engine.output_processor import update_of
from jaxserve.engine.pausing import Controls, Holding
from jaxserve.engine.outputs import Logprob, Update, logprob_entries
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.errors import StepFailed, WarmupCancelled
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.plan import SchedulerStats
from jaxserve.sched.sequence import Sequence
from jaxserve.structured_output.grammar import Constraint

log = logging.getLogger(__name__)


class AsyncEngine(Controls):
    def __init__(self, engine: Engine, tokenizer: Tokenizer | None, *, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None):
        """`max_queued_requests` / `max_queued_tokens` (None: unbounded) bound the requests waiting to
        start and their prompt tokens (`admission`, which the API admits requests through)."""
        self.engine = engine
        self.admission = QueueBound(max_queued_requests, max_queued_tokens,
                                    lambda: (engine.stats.num_queued_requests, engine.stats.num_queued_tokens))
        self.tokenizer = tokenizer  # None: the engine runs on token ids alone (skip_tokenizer_init)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # (a command taken from _commands mid-step, applied after it)
        self._deferred: Abort | AbortAll | End | Control | None = None
        self._subscribers: dict[str, Subscriber] = {}  # engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False  # set (under _lock) once the loop takes no more commands
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self.holding = Holding(engine, self._publish)  # paused, asleep, held requests (the engine thread's)
        self.error: BaseException | None = None  # set if the loop died

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Cancel every request and stop the loop thread; False if it is still in a step after `timeout`.
        Buckets still compiling in the background are finished first, those not started dropped."""
        self._stop.set()
        self._wake.set()
        self.engine.close()  # (also ends a warm-up the loop thread may still wait for)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stats(self) -> SchedulerStats:
        """The engine's figures as of its last change (a snapshot, safe to read from any thread)."""
        return self.engine.stats

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def is_ready(self) -> bool:
        """Running, and warmed up: requests are served now, not queued until the warm-up ends."""
        return self.is_running and self.engine.is_ready

    @property
    def compile_progress(self) -> tuple[int, int]:
        return self.engine.compile_progress

    def check(self, prompt_token_ids: list[int], params: SamplingParams, **options) -> None:
        """ValueError now, in the caller's thread, for a request the engine would refuse (see
        `Engine.check_request`, which takes `options`; the prompt as it runs, truncated)."""
        self.engine.check_request(prompt_token_ids, params, **options)

    def check_constraint(self, constraint: Constraint) -> None:
        """ValueError now, in the caller's thread, for a constraint that does not compile, or not in
        time (`OutputProcessor.check_constraint`): it may take a while, so not on an event loop."""
        self.engine.output.check_constraint(constraint)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, min_weight_version: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Update]:
        """Updates of the request's n sequences until all finish; leaving early aborts them. A step that
        fails raises `StepFailed`. The request waits while the engine is paused, and until its weights
        are at least `min_weight_version`. `lora_request`: the LoRA adapter it runs with."""
        subscriber = Subscriber(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        self.admission.sent(request_id)
        if not self._send(Add(request_id, list(prompt_token_ids), params, subscriber, priority, cache_salt,
                              min_weight_version, lora_request)):
            self.admission.arrived(request_id)
            raise RuntimeError("the engine is not running")
        unfinished = params.n
        try:
            while unfinished:
                item = await subscriber.queue.get()
                if isinstance(item, BaseException):
                    raise item
                unfinished -= item.finish_reason is not None
                yield item
        finally:
            if unfinished:
                self.abort(request_id)

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams, lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        """vLLM's server-side beam search: `beam_search.search`, each round's beams run side by side
        as requests of one token (so they share steps and the prefix cache). A beam's text is that
        of its generated tokens, as in vLLM's server."""
        self.admission.arrived(request_id)  # (its rounds are requests of their own, counted as they wait)
        run = search([prompt_token_ids], params, frozenset(self.engine.model_config.eos_token_ids),
                     self.engine.config)
        step = round_params(params)
        try:
            beams = next(run)
            for r in itertools.count():
                beams = run.send(await asyncio.gather(*(
                    self._candidates(f"{request_id}-{r}-{b}", tokens, step, lora_request)
                    for b, tokens in enumerate(beams))))
        except StopIteration as done:
            (result,) = done.value
        for beam in result.sequences:
            beam.text = "" if self.tokenizer is None else self.tokenizer.decode(beam.tokens[len(prompt_token_ids):])
        return result

    async def _candidates(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          lora_request: LoRARequest | None) -> dict[int, Logprob]:
        """The next-token candidates of one beam (its one token's logprobs entry)."""
        tokens, logprobs = [], []
        async for update in self.generate(request_id, prompt_token_ids, params, lora_request=lora_request):
            if update.finish_reason == "abort":
                raise RuntimeError("the beam search was aborted: the server is shutting down")
            tokens += update.token_ids
            logprobs += update.logprobs
        return logprob_entries(self.tokenizer, tokens, logprobs)[0]

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def abort_requests(self, api_ids: set[str] | None) -> None:
        """End the requests an API id names (`End`), each choice's last update saying "abort"."""
        self._send(End(None if api_ids is None else frozenset(api_ids)))

    def abort_all(self) -> None:
        """End every request now: each unfinished sequence's last update says finish_reason "abort"
        (a stream then ends as usual)."""
        self._send(AbortAll())

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def control(self, fn: Callable[[], object]) -> object:
        """fn() on the engine thread, between steps -> its result (its exception raised here)."""
        done: Future = Future()
        if not self._send(Control(fn, done)):
            raise RuntimeError("the engine is not running")
        return await asyncio.wrap_future(done)

    def _send(self, command: Add | Abort | AbortAll | End | Control) -> bool:
        with self._lock:
            if self._closed or not self._thread.is_alive():
                return False
            self._commands.put(command)
        self._wake.set()
        return True

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            if not self.engine.is_ready:
                self.engine.warmup(background=True, progress=False)
            while not self._stop.is_set():
                self._apply_commands()
                if not self.holding.may_step() or not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    self.engine.runner.keepalive()
                    continue
                try:
                    self.engine.step(on_release=self._publish, arrivals=self._add_arrivals)
                except StepFailed as e:
                    self._fail(e)
        except WarmupCancelled:  # stopped while warming up: no failure
            pass
        except BaseException as e:  # the loop must not die silently: fail every waiter
            log.exception("engine loop failed")
            self.error = e
        finally:
            self._stop.set()
            with self._lock:
                self._closed = True  # every command sent before this is drained below
            reason = self.error or RuntimeError("the server is shutting down")
            self._apply_commands()
            for request_id, sub in list(self._subscribers.items()):
                self.engine.abort(request_id)
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, reason)
            self._subscribers.clear()
            for held in self.holding.fail(reason):
                self.admission.arrived(held.request_id)
                held.subscriber.loop.call_soon_threadsafe(held.subscriber.queue.put_nowait, reason)

    def _fail(self, e: StepFailed) -> None:
        """Tell the failed step's requests why they ended; re-raise (ending the loop) when the engine
        cannot step at all."""
        log.error("a step failed, ending its %d requests (%s); the engine goes on", len(e.request_ids),
                  ", ".join(e.request_ids[:8]), exc_info=e.__cause__)
        for request_id in e.request_ids:
            sub = self._subscribers.pop(request_id, None)
            if sub is not None:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, e)
        if not e.request_ids or not self.engine.runner.can_step:
            raise RuntimeError("the engine cannot step: " + ("its KV cache is lost" if e.request_ids else
                               "a step failed without a request to blame")) from e.__cause__

    def _add_arrivals(self) -> bool:
        """`Engine.step`'s `arrivals`: add the requests sent since the loop last applied its commands,
        up to the first command of another kind, which waits (and those after it) for the step's end.
        -> whether any was added."""
        added = False
        while self._deferred is None:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Add):
                self._add(command)
                added = True
            else:
                self._deferred = command
        return added

    def _apply_commands(self) -> None:
        while True:
            command, self._deferred = self._deferred, None
            if command is None:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return
            if isinstance(command, Add):
                self._add(command)
            elif isinstance(command, AbortAll):
                self._abort_all()
            elif isinstance(command, Control):
                self._control(command)
            elif isinstance(command, End):
                self._end(command.api_ids)
            elif self._subscribers.pop(command.request_id, None) is not None:
                self.engine.abort(command.request_id)
            elif self.holding.forget(command.request_id) is not None:  # (it never started)
                self.admission.arrived(command.request_id)

    def _end(self, api_ids: frozenset[str] | None) -> None:
        """`End`: a held request, which never started, starts first to end as the others do."""
        def named(request_id: str) -> bool:
            return api_ids is None or request_id in api_ids or request_id.rpartition("-")[0] in api_ids

        for held in [held for held in self.holding.held if named(held.request_id)]:
            self._start(self.holding.forget(held.request_id))
        self._abort_all(named)

    def _abort_all(self, which: Callable[[str], bool] = lambda request_id: True) -> None:
        """Abort the running requests `which` picks, each sequence with a last update ("abort")."""
        for request_id in [request_id for request_id in self._subscribers if which(request_id)]:
            for seq in self.engine.abort(request_id):
                self._publish_abort(seq)

    def _control(self, command: Control) -> None:
        if not command.done.set_running_or_notify_cancel():
            return  # (its caller went away first)
        try:
            command.done.set_result(command.fn())
        except StepFailed as e:  # (finishing the step in flight failed: its requests hear of it too)
            command.done.set_exception(e)
            self._fail(e)
        except Exception as e:  # (a refused call: its caller's error)
            command.done.set_exception(e)

    def _add_all(self, commands: list[Add]) -> None:
        for command in commands:
            self._add(command)

    def _add(self, command: Add) -> None:
        if not self.holding.holds(command):
            self._start(command)

    def _start(self, command: Add) -> None:
        sub = command.subscriber
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    priority=command.priority, cache_salt=command.cache_salt,
                                    lora_request=command.lora_request)
        except Exception as e:  # (refused: a ValueError, the request's 400; else a bug, its 500)
            if not isinstance(e, ValueError):
                log.exception("adding request %s failed", command.request_id)
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, e)
            return
        finally:
            self.admission.arrived(command.request_id)
        self._subscribers[command.request_id] = sub

    def _publish_abort(self, seq: Sequence) -> None:
        """The last update of an aborted sequence, and of the siblings it had yet to fork."""
        for index in range(seq.index, seq.index + 1 + seq.pending_forks):
            choice = seq if index == seq.index else dataclasses.replace(
                seq, index=index, token_ids=list(seq.prompt_token_ids), forks=[])
            self._publish(update_of(choice, "", [], [], [], choice.num_output_tokens, self.engine.weight_version))

    def _publish(self, update: Update) -> None:
        sub = self._subscribers.get(update.request_id)
        if sub is None:
            return
        if update.finished:
            sub.unfinished -= 1
            if not sub.unfinished:
                del self._subscribers[update.request_id]
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, update)
        except RuntimeError:  # its event loop has closed (the server is stopping): nobody to tell
            self._subscribers.pop(update.request_id, None)
