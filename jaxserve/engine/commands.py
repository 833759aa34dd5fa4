"""The commands coroutines hand `AsyncEngine`'s thread, applied between steps in the order sent (the
requests sent up to the first other command may also join a step, `AsyncEngine._add_arrivals`)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

from jaxserve.config.lora import LoRARequest
from jaxserve.sample.params import SamplingParams


@dataclasses.dataclass
class Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    unfinished: int  # sequences of the request still running


@dataclasses.dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    subscriber: Subscriber  # where its updates go
    priority: int = 0
    cache_salt: str | None = None
    min_weight_version: int = 0  # held until the weights are at least this version
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class End:
    """End the requests an API id names (the id, or its prompts' `id-i`; None: every request), held
    ones too, each sequence with a last update (finish reason "abort"): their consumers wait."""
    api_ids: frozenset[str] | None


@dataclasses.dataclass(frozen=True)
class AbortAll:
    pass


@dataclasses.dataclass(frozen=True)
class Control:
    """Run `fn` on the engine thread between steps (a pause, new weights, sleep): its result, or its
    exception, completes `done`."""
    fn: Callable[[], object]
    done: Future
