"""The bounded waiting queue of a replica (`--max-num-queued-reqs`, `--max-num-queued-tokens`): the
requests admitted and not yet in its engine's queue, counted with those that are, so that the API
refuses what would overflow it before any work."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from jaxserve.errors import QueueFull

RESERVATION_SECONDS = 30.0  # an admitted request not sent to the engine by then no longer counts as queued


class QueueBound:
    def __init__(self, max_queued_requests: int | None, max_queued_tokens: int | None,
                 engine_queued: Callable[[], tuple[int, int]]):
        """`max_queued_requests` / `max_queued_tokens` (None: unbounded) bound the requests waiting to
        start and their prompt tokens; `engine_queued()`: (requests, prompt tokens) in the engine's own
        queue, as of its last snapshot."""
        self.max_queued_requests, self.max_queued_tokens = max_queued_requests, max_queued_tokens
        self._engine_queued = engine_queued
        # request id -> (prompt tokens, when admitted, when sent or None): admitted, not yet in the engine's queue
        self._admitted: dict[str, tuple[int, float, float | None]] = {}
        self._lock = threading.Lock()

    @property
    def queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting to start: admitted and not yet sent, on their way to the
        engine, or in its queue (as of its last snapshot; one on its way may count twice for a moment)."""
        with self._lock:
            now = time.monotonic()
            for request_id, (_, admitted, sent) in list(self._admitted.items()):
                if sent is None and now - admitted > RESERVATION_SECONDS:  # admitted, then never sent
                    del self._admitted[request_id]
            requests, tokens = len(self._admitted), sum(n for n, _, _ in self._admitted.values())
        engine_requests, engine_tokens = self._engine_queued()
        return requests + engine_requests, tokens + engine_tokens

    def admit(self, requests: list[tuple[str, list[int]]]) -> None:
        """Count (request id, prompt) as queued from now on, or QueueFull where the bounded queue has
        no room for them all. A request alone is admitted into an empty queue whatever its prompt's
        length (it could never be otherwise)."""
        if self.max_queued_requests is not None or self.max_queued_tokens is not None:
            requests_queued, tokens_queued = self.queued
            new_tokens = sum(len(prompt) for _, prompt in requests)
            if self.max_queued_requests is not None and requests_queued + len(requests) > self.max_queued_requests:
                raise QueueFull(f"the server is overloaded: {requests_queued} requests are waiting, and at most "
                                f"{self.max_queued_requests} may wait (--max-num-queued-reqs); retry later")
            if (self.max_queued_tokens is not None and requests_queued
                    and tokens_queued + new_tokens > self.max_queued_tokens):
                raise QueueFull(f"the server is overloaded: {tokens_queued} prompt tokens are waiting, and this "
                                f"request's {new_tokens} would pass the {self.max_queued_tokens} that may wait "
                                "(--max-num-queued-tokens); retry later")
        with self._lock:
            now = time.monotonic()
            self._admitted.update((request_id, (len(prompt), now, None)) for request_id, prompt in requests)

    def sent(self, request_id: str) -> None:
        """An admitted request is on its way to the engine (counted as queued until it arrives)."""
        with self._lock:
            if request_id in self._admitted:
                self._admitted[request_id] = (*self._admitted[request_id][:2], time.monotonic())

    def arrived(self, request_id: str) -> None:
        """An admitted request is in the engine's queue, or refused there, or will not be sent after
        all: no longer counted here."""
        with self._lock:
            self._admitted.pop(request_id, None)

    def arrived_before(self, moment: float) -> None:
        """The requests sent before `moment` (`time.monotonic`) have arrived: the engine's figures
        read after it count them (a remote engine's, read by polling)."""
        with self._lock:
            for request_id, (_, _, sent) in list(self._admitted.items()):
                if sent is not None and sent < moment:
                    del self._admitted[request_id]

    def forget(self, request_ids: list[str]) -> None:
        """Admitted requests that will not be sent after all: no longer counted as queued."""
        for request_id in request_ids:
            self.arrived(request_id)
