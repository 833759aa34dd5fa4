"""An engine a trainer holds (docs/rl.md): paused, asleep, or about to take new weights, and the
requests that wait meanwhile. `Holding` is the engine thread's own (`AsyncEngine`'s loop): nothing
here changes on another thread (which may read `paused`, as of now).

Paused, no step runs. Pausing "wait"s for the requests in flight to finish first (new ones wait);
"keep" (and "abort", once the API has ended them) finishes the step in flight and drops the
running sequences' KV, which they recompute once resumed, under the weights then. A request that
comes while paused, or that asks for newer weights than the engine runs (`min_weight_version`),
is held, and handed back (`released`) to be added once it may start.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from jaxserve.engine.core import Engine
from jaxserve.engine.outputs import Update

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's: end the requests in flight, let them finish, or hold them
# a trainer's controls of an engine, by name (`AsyncEngine.call`, `Replicas.on_every_replica`)
CONTROLS = ("pause", "resume", "is_paused", "sleep", "wake_up", "is_sleeping", "reset_prefix_cache",
            "update_weights_from_path", "check_adapter")


class Held(Protocol):
    """A request not yet added to the engine (`AsyncEngine`'s Add command)."""
    request_id: str
    min_weight_version: int


class Holding:
    def __init__(self, engine: Engine, publish: Callable[[Update], None]):
        self.engine, self.publish = engine, publish
        self.paused: str | None = None  # "wait" (until the requests in flight finish), "paused", or None
        self.held: list[Held] = []
        self._pausing: list[Future] = []  # pause(mode="wait") calls, until nothing runs
        self._clear_cache = False  # pause(mode="wait")'s
        self._by_sleep = False  # sleep paused the engine: waking resumes it

    def may_step(self) -> bool:
        """Whether the loop may step (while pausing "wait", the requests in flight still do): pausing
        completes here once they have finished."""
        if self.paused == "wait" and not self.engine.has_unfinished():
            self._hold_all(self._clear_cache)
        return self.paused != "paused"

    def holds(self, request: Held) -> bool:
        """Whether `request` waits (held) rather than being added now."""
        if self.paused is not None or request.min_weight_version > self.engine.weight_version:
            self.held.append(request)
            return True
        return False

    def forget(self, request_id: str) -> bool:
        """Drop a held request (aborted before it started) -> whether it was held."""
        kept = [held for held in self.held if held.request_id != request_id]
        found, self.held = len(kept) < len(self.held), kept
        return found

    def pause(self, mode: str, clear_cache: bool) -> Future | None:
        """vLLM's pause_generation: no step runs until `resume`; the requests in flight have ended
        ("abort", with what they have), finish first ("wait"), or wait ("keep"), dropping their KV to
        recompute it on resume (under the weights then). New requests wait for `resume`. `clear_cache`
        resets the prefix cache. -> a Future that completes once paused, where that waits ("wait")."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose from {list(PAUSE_MODES)}")
        if mode == "wait" and self.engine.has_unfinished() and self.paused != "paused":
            self.paused, self._clear_cache = "wait", clear_cache
            pausing = Future()
            pausing.set_running_or_notify_cancel()  # (its caller may go away: it completes all the same)
            self._pausing.append(pausing)
            return pausing
        self._hold_all(clear_cache)
        return None

    def _hold_all(self, clear_cache: bool) -> None:
        """Paused: the step in flight finished, the running sequences' KV dropped (they recompute it)."""
        self.engine.drain(self.publish)
        self.engine.scheduler.preempt_all()
        if clear_cache:
            self.engine.scheduler.allocator.reset_prefix_cache()
        self.engine.stats = self.engine.scheduler.stats()
        self.paused = "paused"
        self._end_pausing(None)

    def _end_pausing(self, error: BaseException | None) -> None:
        for pausing in self._pausing:
            if error is None:
                pausing.set_result(None)
            else:
                pausing.set_exception(error)
        self._pausing.clear()

    def resume(self) -> list[Held]:
        """-> the requests held, to add now. A pause still waiting for the requests in flight fails."""
        if self.engine.is_sleeping:
            raise ValueError("the engine is asleep: wake_up first (it resumes by itself where sleep paused it)")
        self.paused, self._by_sleep = None, False
        self._end_pausing(ValueError("resumed before the requests in flight finished"))
        return self.released()

    def released(self) -> list[Held]:
        """The held requests, to add now (those that still may not start are held again)."""
        held, self.held = self.held, []
        return held

    def update_weights(self, leaves: list, weight_version: int) -> list[Held]:
        """`Engine.update_weights` -> the requests held, to add now, unless paused (a pause of sleep's
        ends where the engine is awake again)."""
        self.engine.update_weights(leaves, weight_version, self.publish)
        if self._by_sleep and not self.engine.is_sleeping:
            return self.resume()
        return self.released() if self.paused is None else []

    def sleep(self, level: int) -> None:
        """`Engine.sleep`, pausing ("keep") until awake if not paused."""
        self.engine.sleep(level, self.publish)
        if self.paused != "paused":
            self._hold_all(clear_cache=True)
            self._by_sleep = True

    def wake_up(self, tags: list[str] | None) -> list[Held]:
        self.engine.wake_up(tags)
        return self.resume() if not self.engine.is_sleeping and self._by_sleep else []

    def fail(self, reason: BaseException) -> list[Held]:
        """The loop ends: pauses under way fail -> the requests held, to fail."""
        self._end_pausing(reason)
        return self.released()
