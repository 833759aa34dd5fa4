"""The engine's exceptions, in one place: what the API and `LLM` catch and map to answers."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot run, and the request field it is about (None: no one field), so
    that the API reports the engine's own check, once, under the field's name."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class StepFailed(RuntimeError):
    """A step raised (a device error, a logits processor's or a grammar's bug): the requests it
    computed have been ended (their pages freed); the engine goes on with the others."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the step computing this request failed: {type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class QueueFull(Exception):
    """A request the bounded waiting queue has no room for (the API's 503)."""


class WarmupCancelled(RuntimeError):
    """The compiler was closed before the buckets waited for were compiled (the engine is stopping)."""


class CompilerCrash(Exception):
    """The grammar brought the compiler down (in the child)."""


class ReplicaLost(RuntimeError):
    """The data-parallel replica running a request went away (its Ray actor died). Before any of the
    request's output was sent, the request runs on another replica instead."""
