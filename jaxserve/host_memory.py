"""glibc's malloc set up so that a CPU step's temporaries reuse memory instead of fresh pages.

XLA:CPU allocates each step's temporaries with one malloc on a worker thread of its pool (tens of MB
from a few rows on: the logits and the sampler's work on them). glibc serves a block that large with a
fresh mmap (its threshold tops out at 32 MB), or from a heap of the thread's arena that it unmaps once
free again; either way every page the step touches faults and is zeroed by the kernel, each step. With
no mmap, a trim threshold above a step's temporaries, and a top pad of a whole thread heap (an arena
keeps a free heap only while the pad asks for that much room), the freed block stays mapped and the
next step reuses it. A block past a thread heap's 64 MB (the default model's step from about 38 rows)
is still mapped afresh each step: a thread's arena maps it whatever the settings.

Each thread keeps an arena of its own, as glibc does by default: with one arena shared by the server's
threads (the event loop, the engine's launches, XLA's pool), the served speed was lower and less steady
(bench/RESULTS.md, "glibc's arenas in the server").

Only where JAX can run on nothing but the CPU: a TPU or GPU host keeps glibc's defaults, since
there the big host allocations (weights on their way to the device) should go back to the system
once freed. `jaxserve` calls it on import.

The server goes one step further where the system has tcmalloc (Debian's libtcmalloc-minimal4, which
vLLM's CPU build preloads too): `run_server.py` runs itself again with it preloaded (`preload_tcmalloc`).
glibc's arena costs the engine thread's small blocks between steps (a launch's, the inputs' arrays) the
walks of its free lists; tcmalloc's per-thread caches do not (bench/RESULTS.md, "tcmalloc in the server").
Its release rate is set to 0 (unless given): freed pages stay mapped, as with glibc's settings above.
`JAXSERVE_MALLOC=glibc` keeps glibc with the settings above, `=default` glibc's own settings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
# free memory at the top of the heap beyond this goes back to the system: above a step's temporaries
# at the batch sizes a CPU serves (about 1.7 MB per row of a 49,152-token vocabulary)
TRIM_THRESHOLD = 1 << 30
# glibc's HEAP_MAX_SIZE on 64-bit hosts: the most a thread arena's heap holds
TOP_PAD = 64 << 20
TCMALLOC_RELEASE = "TCMALLOC_RELEASE_RATE"  # how fast tcmalloc gives freed pages back to the system


def cpu_only() -> bool:
    """Whether JAX here can run only on the CPU: JAX_PLATFORMS says so, or no accelerator plugin
    (a `jax_plugins` entry point, libtpu) is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",") == ["cpu"]
    return not importlib.metadata.entry_points(group="jax_plugins") and importlib.util.find_spec("libtpu") is None


def reuse_freed_memory() -> bool:
    """Sets glibc's malloc as above where JAX runs on the CPU only; True where it did."""
    if not sys.platform.startswith("linux") or os.environ.get("JAXSERVE_MALLOC") in ("default", "tcmalloc") or \
            not cpu_only():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # (glibc's; another libc keeps its own ways)
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))


def tcmalloc_to_preload() -> str | None:
    """The tcmalloc library `preload_tcmalloc` preloads: where JAX runs on the CPU only, JAXSERVE_MALLOC is
    unset, no allocator is preloaded yet and the system has tcmalloc; else None."""
    if not sys.platform.startswith("linux") or "JAXSERVE_MALLOC" in os.environ or \
            "malloc" in os.environ.get("LD_PRELOAD", "") or not cpu_only():
        return None
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def preload_tcmalloc() -> None:
    """Runs this process's command again (`os.execve`: the same process id) with `tcmalloc_to_preload`
    preloaded, if any; else returns. Call it before the heavy imports: they would be made twice."""
    library = tcmalloc_to_preload()
    if library is not None:
        preload = ":".join(filter(None, (library, os.environ.get("LD_PRELOAD"))))
        # (freed memory kept mapped, as the glibc settings above keep it, for the next step's temporaries)
        environ = {TCMALLOC_RELEASE: "0", **os.environ, "LD_PRELOAD": preload, "JAXSERVE_MALLOC": "tcmalloc"}
        os.execve(sys.executable, sys.orig_argv, environ)
