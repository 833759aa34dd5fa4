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

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

from checkpoints import resolve_model
from jaxserve.config.lora import LoRARequest
from jaxserve.engine.core import Engine
from jaxserve.engine.outputs import Update

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's: end the requests in flight, let them finish, or hold them
# a trainer's controls of an engine, by name (`AsyncEngine.call`, `Replicas.on_every_replica`)
CONTROLS = ("pause", "resume", "is_paused", "sleep", "wake_up", "is_sleeping", "reset_prefix_cache",
            "release_kv_cache_memory", "update_weights_from_path", "check_adapter")
SLEEP_LEVELS = (0, 1, 2)  # vLLM's: a pause alone; and the KV cache freed; and the weights freed too


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
        self._by_sleep = False  # sleep (level 1, 2) paused the engine: new weights that wake it resume it

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

    def forget(self, request_id: str) -> Held | None:
        """Drop a held request (aborted before it started) -> it, where it was held."""
        found = next((held for held in self.held if held.request_id == request_id), None)
        self.held = [held for held in self.held if held is not found]
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
        """Once paused (`pause`): at level 1 and 2, `Engine.sleep`. Where new weights wake it (not
        `wake_up`), its pause ends too; a level 0 pause waits for `wake_up`."""
        if self.paused != "paused":  # (resumed since)
            self._hold_all(clear_cache=level >= 1)
        if level >= 1:
            self.engine.sleep(level, self.publish)
        self._by_sleep = level >= 1

    def release_kv_cache(self) -> None:
        """vLLM's release_kv_cache_memory: paused (sleep level 0, or `pause`), free the KV cache until
        `wake_up`."""
        if self.paused != "paused":
            raise ValueError("release_kv_cache_memory needs a completed pause first (sleep level 0, or pause)")
        if self.engine.is_sleeping:
            raise ValueError("release_kv_cache_memory needs the engine's memory resident: it is asleep")
        self.engine.release_kv_cache(self.publish)

    def wake_up(self, tags: list[str] | None) -> list[Held]:
        """`Engine.wake_up`; once all is awake, a pause (sleep's or not, vLLM's way) ends -> the requests
        held, to add now."""
        self.engine.wake_up(tags)
        return self.resume() if not self.engine.is_sleeping and self.paused is not None else []

    def fail(self, reason: BaseException) -> list[Held]:
        """The loop ends: pauses under way fail -> the requests held, to fail."""
        self._end_pausing(reason)
        return self.released()


class Controls:
    """`AsyncEngine`'s part: a trainer's controls (`CONTROLS`), each run on the engine thread between
    steps (`AsyncEngine.control`), on its `engine` and `holding`."""

    async def call(self, method: str, *args) -> object:
        """One of a trainer's controls (`CONTROLS`) by name: what a replica elsewhere is asked for."""
        if method not in CONTROLS:
            raise ValueError(f"unknown control {method!r}: choose from {list(CONTROLS)}")
        return await getattr(self, method)(*args)

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's pause_generation (`Holding.pause`; "abort" ends the requests in flight first)."""
        drained = await self.control(lambda: self._pause(mode, clear_cache))
        if drained is not None:
            await asyncio.wrap_future(drained)

    async def resume(self) -> None:
        await self.control(lambda: self._add_all(self.holding.resume()))

    async def is_paused(self) -> bool:
        return self.holding.paused is not None

    async def is_sleeping(self) -> bool:
        """vLLM's: paused (sleep level 0, or `pause`) or memory freed."""
        return self.holding.paused is not None or self.engine.is_sleeping

    async def update_weights(self, leaves: list, weight_version: int) -> int:
        """`Engine.update_weights` between steps; requests held for these weights start. -> the version."""
        return await self.control(lambda: self._update_weights(leaves, weight_version))

    async def update_weights_from_path(self, path: str, weight_version: int) -> int:
        """`update_weights` from a checkpoint, read off the engine thread (steps go on meanwhile)."""
        layout = self.engine.weight_layout
        loaded = await asyncio.to_thread(lambda: layout.leaves(layout.from_checkpoint(resolve_model(path))))
        return await self.update_weights(loaded, weight_version)

    async def check_adapter(self, lora_request: LoRARequest) -> None:
        """`Engine.check_adapter`, its files read off the engine thread (steps go on meanwhile)."""
        await asyncio.to_thread(self.engine.check_adapter, lora_request)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: pause as `mode` says (`pause`; the prefix cache reset from level 1 on), then level 1
        and 2 free memory (`Engine.sleep`) until `wake_up`."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {list(SLEEP_LEVELS)}, not {level!r}")
        await self.pause(mode, clear_cache=level >= 1)
        await self.control(lambda: self.holding.sleep(level))

    async def release_kv_cache_memory(self) -> None:
        await self.control(self.holding.release_kv_cache)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """`Holding.wake_up` (tags: "weights", "kv_cache", "scheduling") -> whether all is awake."""
        return await self.control(lambda: self._add_all(self.holding.wake_up(tags)) or not self.engine.is_sleeping)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget the prefix cache's pages (false while running sequences hold some, unless
        `reset_running_requests`: they drop their KV first, to recompute it). No KV connector here:
        `reset_connector` has nothing more to reset."""
        def reset() -> bool:
            if reset_running_requests:
                self.engine.preempt_running(self._publish)
            return self.engine.scheduler.allocator.reset_prefix_cache()
        return await self.control(reset)

    def _pause(self, mode: str, clear_cache: bool) -> Future | None:
        if mode == "abort":
            self._abort_all()
        return self.holding.pause(mode, clear_cache)

    def _update_weights(self, leaves: list, weight_version: int) -> int:
        self._add_all(self.holding.update_weights(leaves, weight_version))
        return self.engine.weight_version
