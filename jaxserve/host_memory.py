"""glibc's malloc set up so that a CPU step's temporaries reuse memory instead of fresh pages.

XLA:CPU allocates each step's temporaries with malloc on a worker thread of its pool (tens of MB
from a few rows on: the logits and the sampler's work on them). glibc serves an allocation that
large with a fresh mmap (its threshold tops out at 32 MB), or from a thread arena's heap that it
unmaps once free again; either way every page the step touches faults and is zeroed by the kernel,
each step. With one arena (the main one, grown by brk), no mmap, and a trim threshold above a step's
temporaries, the freed block stays mapped and the next step reuses it, once the heap has grown over
the first steps to hold the blocks that small allocations split (bench/RESULTS.md, "Fresh pages per
step").

Only where JAX can run on nothing but the CPU: a TPU or GPU host keeps glibc's defaults, since
there the big host allocations (weights on their way to the device) should go back to the system
once freed. Set before JAX creates its CPU client's threads (a thread keeps the arena it first
used): `jaxserve` calls it on import.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# free memory at the top of the heap beyond this goes back to the system: above a step's temporaries
# at the batch sizes a CPU serves (about 1.7 MB per row of a 49,152-token vocabulary)
TRIM_THRESHOLD = 1 << 30


def cpu_only() -> bool:
    """Whether JAX here can run only on the CPU: JAX_PLATFORMS says so, or no accelerator plugin
    (a `jax_plugins` entry point, libtpu) is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",") == ["cpu"]
    return not importlib.metadata.entry_points(group="jax_plugins") and importlib.util.find_spec("libtpu") is None


def reuse_freed_memory() -> bool:
    """Sets glibc's malloc as above where JAX runs on the CPU only; True where it did."""
    if not sys.platform.startswith("linux") or os.environ.get("JAXSERVE_MALLOC") == "default" or not cpu_only():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # (glibc's; another libc keeps its own ways)
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
