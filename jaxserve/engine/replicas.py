"""Data-parallel replicas behind one front: `Router` picks the replica of each request, by load and
by prefix affinity; `Replicas` gives the API one `AsyncEngine`'s interface over several.

A request goes to the replica that holds the longest prefix of its prompt (the pages the prefix
cache would reuse), unless that replica's load is more than a batch (`max_num_seqs`) above the
least loaded one's: then to the least loaded. The load is vLLM's balancing score: 4 x waiting +
running. What a replica holds is what the router sent it: the keys of each prompt's full pages
(`prefix_hashes`, the prefix cache's own) are remembered for the replica they went to, the most
recent `PREFIX_ENTRIES` of them (SGLang's router approximates the same way).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Sequence

from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxserve.engine.outputs import Update
from jaxserve.errors import QueueFull, ReplicaLost
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.pages import prefix_hashes, salt_seed
from jaxserve.sched.plan import SchedulerStats
from jaxserve.structured_output.grammar import Constraint

log = logging.getLogger(__name__)

PREFIX_ENTRIES = 1 << 18  # page keys remembered (32 bytes each, with their dict entries: tens of MB at most)
WAITING_WEIGHT = 4  # vLLM's: a waiting request weighs as four running ones


class Router:
    def __init__(self, replicas: int, page_size: int, slack: int):
        """`slack`: how much more loaded than the least loaded replica the one holding a prompt's
        prefix may be and still be chosen."""
        self.replicas, self.page_size, self.slack = replicas, page_size, slack
        self._owner: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # page key -> replica
        self._next = 0  # where ties between equally loaded replicas are broken from (in turn)

    def choose(self, prompt_token_ids: list[int], cache_salt: str | None, loads: Sequence[float]) -> int:
        """The replica for this prompt, given each replica's load now; remembers its pages there."""
        if self.replicas == 1:
            return 0
        keys = prefix_hashes(prompt_token_ids, self.page_size, salt_seed(cache_salt))
        holder = None
        for key in keys:
            if key not in self._owner:
                break
            holder = self._owner[key]
        least = min(range(self.replicas), key=lambda r: (loads[r], (r - self._next) % self.replicas))
        chosen = holder if holder is not None and loads[holder] - loads[least] <= self.slack else least
        self._next = (chosen + 1) % self.replicas
        for key in keys:
            self._owner[key] = chosen
            self._owner.move_to_end(key)
        while len(self._owner) > PREFIX_ENTRIES:
            self._owner.popitem(last=False)
        return chosen


def load_of(replica: AsyncEngine) -> float:
    """vLLM's balancing score: requests waiting to start (those on their way too) weigh four times
    the sequences running."""
    return WAITING_WEIGHT * replica.admission.queued[0] + replica.stats.num_running


def total_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' figures added up (the per-position acceptance counts position by position)."""
    def add(values):
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
        self.router = Router(len(replicas), config.page_size, config.max_num_seqs)
        self._routes: dict[str, int] = {}  # request id -> its replica, from admission to its end

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
        return all([replica.shutdown(timeout) for replica in self.replicas])

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
        """Route each (request id, prompt) and count it as queued on its replica (`QueueBound.admit`:
        QueueFull where a replica's bounded queue has no room; then none of them is admitted)."""
        groups: dict[int, list[tuple[str, list[int]]]] = collections.defaultdict(list)
        for request_id, prompt in requests:
            groups[self._route(request_id, prompt, cache_salt)].append((request_id, prompt))
        admitted = []
        try:
            for replica, group in groups.items():
                self.replicas[replica].admission.admit(group)
                admitted.append((replica, group))
        except QueueFull:
            for replica, group in admitted:
                self.replicas[replica].admission.forget([request_id for request_id, _ in group])
            for request_id, _ in requests:
                self._routes.pop(request_id, None)
            raise

    def _route(self, request_id: str, prompt: list[int], cache_salt: str | None, avoid: set[int] = frozenset()
               ) -> int:
        """The request's replica, chosen now if it has none: among those ready, less those to `avoid`
        (all of them, where none is ready: the request then waits there)."""
        if len(self.replicas) == 1:
            return 0
        if request_id not in self._routes:
            usable = [r not in avoid and replica.is_ready for r, replica in enumerate(self.replicas)]
            if not any(usable):
                usable = [r not in avoid for r in range(len(self.replicas))]
            loads = [load_of(replica) if ok else math.inf for replica, ok in zip(self.replicas, usable)]
            self._routes[request_id] = self.router.choose(prompt, cache_salt, loads)
        return self._routes[request_id]

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[Update]:
        """The request's updates from its replica. Where that replica goes away before any update
        came (`ReplicaLost`), from another one, once per replica; after an update, ReplicaLost."""
        lost: set[int] = set()
        try:
            while True:
                route = self._route(request_id, prompt_token_ids, cache_salt, lost)
                sent = False
                try:
                    async for update in self.replicas[route].generate(request_id, prompt_token_ids, params,
                                                                      priority=priority, cache_salt=cache_salt):
                        sent = True
                        yield update
                    return
                except ReplicaLost:
                    lost.add(route)
                    self._routes.pop(request_id, None)
                    if sent or len(lost) == len(self.replicas):
                        raise
                    log.warning("request %s: replica %d went away before it answered; sending it to another",
                                request_id, route)
        finally:
            self._routes.pop(request_id, None)

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams) -> BeamSearchOutput:
        try:
            return await self.replicas[self._route(request_id, prompt_token_ids, None)].beam_search(
                request_id, prompt_token_ids, params)
        finally:
            self._routes.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        replica = self._routes.get(request_id)
        for r in self.replicas if replica is None else [self.replicas[replica]]:
            r.abort(request_id)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()
