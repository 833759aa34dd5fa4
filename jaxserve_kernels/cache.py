"""Where jaxserve keeps what it builds or fetches once per machine (compiled CPU kernels, executables,
GGUF views, the default model): under $XDG_CACHE_HOME, else ~/.cache. At the bottom of the project
so that every layer may use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxserve"
