"""Data-parallel replicas behind one front: `Router` picks the replica of each request, by load and
by prefix affinity; `Replicas` gives the API one `AsyncEngine`'s interface over several.

A request goes to the replica that holds the longest prefix of its prompt (the pages the prefix
cache would reuse), where that prefix is at least half the prompt (`MIN_SHARE`) and that replica's
load is at most `slack` above the least loaded one's (SGLang's router decides the same way), unless
it would wait there for a seat while the least loaded one has one free; otherwise to the least
loaded replica. The load is vLLM's balancing score, 4 x waiting + running, of the requests the front
sent the replica and has not seen finish (the first `max_num_seqs` of them run, the others wait): a
replica's own figures lag its steps, and a burst read from them piled requests on one replica while
another had free seats. What a replica holds is what the router sent it: the keys of each prompt's
full pages (`prefix_hashes`, the prefix cache's own) are remembered for the replica they went to, the
most recent `PREFIX_ENTRIES` of them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence

from jaxserve.config.lora import LoRARequest
from jaxserve.engine.admission import RESERVATION_SECONDS
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxserve.engine.outputs import Update
from jaxserve.errors import QueueFull, ReplicaLost
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.pages import prefix_hashes, salt_seed
from jaxserve.sched.plan import SchedulerStats
from jaxserve.structured_output.grammar import Constraint
from jaxserve.worker.weight_update import next_weight_version

log = logging.getLogger(__name__)

PREFIX_ENTRIES = 1 << 18  # page keys remembered (32 bytes each, with their dict entries: tens of MB at most)
WAITING_WEIGHT = 4  # vLLM's: a waiting request weighs as four running ones
MIN_SHARE = 0.5  # the share of a prompt a replica's cached prefix must cover to draw it (SGLang's cache threshold)
MAX_SLACK = 32  # the most a prefix's replica may be loaded above the least loaded one (SGLang's balance threshold)


class Router:
    @classmethod
    def for_config(cls, replicas: int, config) -> Router:
        return cls(replicas, config.page_size, min(config.max_num_seqs, MAX_SLACK), config.max_num_seqs)

    def __init__(self, replicas: int, page_size: int, slack: int, seats: float = math.inf):
        """`slack`: how much more loaded than the least loaded replica the one holding a prompt's
        prefix may be and still be chosen (`for_config`: a batch, at most MAX_SLACK); `seats`: each
        replica's sequences (a load under it: a seat is free)."""
        self.replicas, self.page_size, self.slack, self.seats = replicas, page_size, slack, seats
        self._owner: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # page key -> replica
        self._next = 0  # where ties between equally loaded replicas are broken from (in turn)

    def choose(self, prompt_token_ids: list[int], cache_salt: str | None, loads: Sequence[float]) -> int:
        """The replica for this prompt, given each replica's load now; remembers its pages there."""
        if self.replicas == 1:
            return 0
        keys = prefix_hashes(prompt_token_ids, self.page_size, salt_seed(cache_salt))
        holder, held = None, 0
        for key in keys:
            if key not in self._owner:
                break
            holder, held = self._owner[key], held + 1
        least = min(range(self.replicas), key=lambda r: (loads[r], (r - self._next) % self.replicas))
        draws = holder is not None and held * self.page_size >= MIN_SHARE * len(prompt_token_ids)
        waits = loads[holder] >= self.seats > loads[least] if draws else False  # (for a seat, with one free there)
        chosen = holder if draws and not waits and loads[holder] - loads[least] <= self.slack else least
        self._next = (chosen + 1) % self.replicas
        for key in keys:
            self._owner[key] = chosen
            self._owner.move_to_end(key)
        while len(self._owner) > PREFIX_ENTRIES:
            self._owner.popitem(last=False)
        return chosen


def total_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' figures added up (the per-position acceptance counts position by position; the
    names of LoRA adapters, those of any replica)."""
    def add(values):
        if any(isinstance(v, tuple) and any(isinstance(name, str) for name in v) for v in values):
            return tuple(sorted(set().union(*values)))
        if isinstance(values[0], dict):
            return dict(sum((collections.Counter(v) for v in values), collections.Counter()))
        if isinstance(values[0], tuple):
            width = max(map(len, values))
            return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
        return sum(values)
    return SchedulerStats(**{f.name: add([getattr(s, f.name) for s in stats]) for f in dataclasses.fields(stats[0])})


class Replicas:
    """One `AsyncEngine`'s interface (what the API calls) over data-parallel replicas: each
    request runs on the one `Router` picks when it is admitted (or when it starts, if it was not)."""

    def __init__(self, replicas: list[AsyncEngine]):
        self.replicas = replicas
        config = replicas[0].engine.config
        self.router = Router.for_config(len(replicas), config)
        self._pending: dict[str, tuple[int, float]] = {}  # request id -> (its replica, when admitted): not started
        self._active: dict[str, int] = {}  # request id -> its replica, while it runs

    @property
    def tokenizer(self):
        return self.replicas[0].tokenizer

    @property
    def engine(self):
        """What every replica shares (the model, the engine's configuration, the sampling defaults):
        the first one's `Engine`, or `EngineSpec` where it runs elsewhere."""
        return self.replicas[0].engine

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Every replica's `shutdown` at once (one after another, each would compile on until its turn)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
            return all(list(pool.map(lambda replica: replica.shutdown(timeout), self.replicas)))

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def stats(self) -> SchedulerStats:
        return total_stats([replica.stats for replica in self.replicas])

    @property
    def is_running(self) -> bool:
        return all(replica.is_running for replica in self.replicas)

    @property
    def is_ready(self) -> bool:
        """Serving: a replica is (requests go to those that are; Ray restarts the others)."""
        return any(replica.is_ready for replica in self.replicas)

    @property
    def compile_progress(self) -> tuple[int, int]:
        done, total = zip(*(replica.compile_progress for replica in self.replicas))
        return sum(done), sum(total)

    @property
    def queued(self) -> tuple[int, int]:
        requests, tokens = zip(*(replica.admission.queued for replica in self.replicas))
        return sum(requests), sum(tokens)

    def check(self, prompt_token_ids: list[int], params: SamplingParams, **options) -> None:
        self.replicas[0].check(prompt_token_ids, params, **options)

    def check_constraint(self, constraint: Constraint) -> None:
        self.replicas[0].check_constraint(constraint)

    def admit(self, requests: list[tuple[str, list[int]]], cache_salt: str | None = None) -> None:
        """Route each (request id, prompt) and count it as queued on its replica, or QueueFull where
        no replica's bounded queue has room for one of them (then none of them is admitted). A
        request the router sends to a full replica goes to the least loaded one with room."""
        admitted = []
        try:
            for request_id, prompt in requests:
                replica = self._choose(prompt, cache_salt)
                others = sorted((r for r in range(len(self.replicas)) if r != replica), key=self.load)
                for candidate in (replica, *others):
                    try:
                        self.replicas[candidate].admission.admit([(request_id, prompt)])
                    except QueueFull as e:
                        full = e
                        continue
                    if len(self.replicas) > 1:  # (one replica: every request is its)
                        self._pending[request_id] = candidate, time.monotonic()
                    admitted.append(request_id)
                    break
                else:
                    raise full
        except QueueFull:
            for request_id in admitted:
                replica, _ = self._pending.pop(request_id, (0, 0.0))
                self.replicas[replica].admission.forget([request_id])
            raise
        now = time.monotonic()  # (admitted, then never sent: as the queue's reservation, forgotten)
        for request_id, (_, admitted_at) in list(self._pending.items()):
            if now - admitted_at > RESERVATION_SECONDS:
                del self._pending[request_id]

    def _choose(self, prompt: list[int], cache_salt: str | None, avoid: set[int] = frozenset()) -> int:
        """The router's replica for a prompt: among those ready, less those to `avoid` (all of them,
        where none is ready: the request then waits there)."""
        if len(self.replicas) == 1:
            return 0
        usable = [r not in avoid and replica.is_ready for r, replica in enumerate(self.replicas)]
        if not any(usable):
            usable = [r not in avoid for r in range(len(self.replicas))]
        loads = [self.load(r) if ok else math.inf for r, ok in enumerate(usable)]
        return self.router.choose(prompt, cache_salt, loads)

    def load(self, replica: int) -> float:
        """vLLM's balancing score of a replica: the requests this front sent it and has not seen finish
        (admitted or running), of which those past its seats wait and weigh four times."""
        sent = (sum(route == replica for route, _ in self._pending.values())
                + sum(route == replica for route in self._active.values()))
        seats = self.router.seats
        return WAITING_WEIGHT * max(0, sent - seats) + min(sent, seats)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 priority: int = 0, cache_salt: str | None = None, min_weight_version: int = 0,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[Update]:
        """The request's updates from its replica (the one it was admitted to). Where that replica
        goes away before any update came (`ReplicaLost`), from another one, once per replica; after
        an update, ReplicaLost. One replica's stream is its own (no layer between it and the API)."""
        if len(self.replicas) == 1:
            return self.replicas[0].generate(request_id, prompt_token_ids, params, priority=priority,
                                             cache_salt=cache_salt, min_weight_version=min_weight_version,
                                             lora_request=lora_request)
        return self._generate(request_id, prompt_token_ids, params, priority, cache_salt, min_weight_version,
                              lora_request)

    async def _generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                        cache_salt: str | None, min_weight_version: int, lora_request: LoRARequest | None
                        ) -> AsyncIterator[Update]:
        route, _ = self._pending.pop(request_id, (None, 0.0))
        lost: set[int] = set()
        try:
            while True:
                route = self._choose(prompt_token_ids, cache_salt, lost) if route is None else route
                self._active[request_id] = route
                sent = False
                try:
                    async for update in self.replicas[route].generate(
                            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt,
                            min_weight_version=min_weight_version, lora_request=lora_request):
                        sent = True
                        yield update
                    return
                except ReplicaLost:
                    lost.add(route)
                    if sent or len(lost) == len(self.replicas):
                        raise
                    log.warning("request %s: replica %d went away before it answered; sending it to another",
                                request_id, route)
                    route = None
        finally:
            self._active.pop(request_id, None)

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams, lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        route, _ = self._pending.pop(request_id, (None, 0.0))
        route = self._choose(prompt_token_ids, None) if route is None else route
        self._active[request_id] = route
        try:
            return await self.replicas[route].beam_search(request_id, prompt_token_ids, params, lora_request)
        finally:
            self._active.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        replica = self._active.get(request_id)
        for r in self.replicas if replica is None else [self.replicas[replica]]:
            r.abort(request_id)

    def abort_requests(self, api_ids: set[str] | None) -> None:
        """`AsyncEngine.abort_requests` on every replica."""
        for replica in self.replicas:
            replica.abort_requests(api_ids)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    # --- a trainer's controls (docs/rl.md), on every replica at once ---

    @property
    def weight_version(self) -> int:
        return max(replica.weight_version for replica in self.replicas)

    async def on_every_replica(self, method: str, *args) -> list:
        """`method(*args)` of every replica (pause, resume, sleep, wake_up, reset_prefix_cache) -> their results."""
        return await asyncio.gather(*(replica.call(method, *args) for replica in self.replicas))

    def next_version(self, weight_version: int | None) -> int:
        """The version new weights take: the one asked for, else one more than the newest now (the same
        on every replica)."""
        return next_weight_version(self.weight_version, weight_version)

    def local_engines(self) -> list:
        """Each replica's `Engine`, where all run in this process (not on Ray): new weights as arrays
        reach only those."""
        engines = [getattr(replica, "engine", None) for replica in self.replicas]
        if not all(hasattr(engine, "weight_layout") for engine in engines):
            raise ValueError("weights sent as tensors reach replicas of this process only; replicas on Ray load "
                             "theirs from a path (/update_weights_from_disk)")
        return engines
