"""Classes a user names by their module path: logits processors, a worker extension."""

from __future__ import annotations

import importlib


def import_class(qualified: str, what: str) -> type:
    """"package.module.Class" (or "package.module:Class") -> the class; ValueError, naming `what`, where
    it cannot be imported or is not a class."""
    module, _, name = qualified.rpartition(":") if ":" in qualified else qualified.rpartition(".")
    if not module:
        raise ValueError(f"{what} {qualified!r}: give it as module.Class or module:Class")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what} {qualified!r} cannot be imported: {e}") from e
    if not isinstance(found, type):
        raise ValueError(f"{what} {qualified!r} is not a class")
    return found
