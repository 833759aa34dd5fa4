"""OpenAI's background responses (`"background": true`, stored): the request is answered at once
(status "queued"), and the response is computed by a task of its own, not tied to the request's
connection. GET /v1/responses/{id} reads it as it grows; GET ...?stream=true&starting_after=N
streams its events from event N + 1 on (those sent before, then the rest as they come); POST
/v1/responses/{id}/cancel stops it (status "cancelled")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from api.response_objects import ResponseObject

_RUNNING: set[asyncio.Task] = set()  # (the loop keeps only weak references to its tasks)
UNFINISHED = ("queued", "in_progress")


class BackgroundRun:
    """The task computing one background response, and the events it has made so far (the event of
    sequence number k at index k)."""

    def __init__(self, response: ResponseObject, events: AsyncIterator[str]):
        self.response = response
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run(events))
        _RUNNING.add(self.task)
        self.task.add_done_callback(_RUNNING.discard)

    async def _run(self, events: AsyncIterator[str]) -> None:
        try:
            async for event in events:
                self.events.append(event)
                self._wake()
        except asyncio.CancelledError:  # (here, not in `cancel`: the canceller's client may be gone by now)
            self._cancelled()
            raise
        finally:
            self._end()

    def _cancelled(self) -> None:
        if self.response.status in UNFINISHED:
            self.response.status = "cancelled"

    def _end(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, starting_after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number `starting_after`, up to the last one the task makes."""
        index = starting_after + 1
        while True:
            changed = self._changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            await changed.wait()

    async def cancel(self) -> None:
        """Stop the task (its sequences are aborted) where it has not finished; the response is then
        "cancelled" (one that finished first keeps its status: cancelling again changes nothing)."""
        if not self.done:
            self.task.cancel()
            self._cancelled()  # (a task cancelled before it ran never runs `_run`)
            self._end()
            await asyncio.wait([self.task])
