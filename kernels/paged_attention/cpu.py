"""Ragged paged attention on CPU: a C++ XLA FFI custom call (`cpu.cc`), built on first use.

XLA:CPU runs the jnp formulations poorly: each query tile gathers its sequence's whole context
(up to the page-table width) into a transposed copy, then multiplies it in small batched products
at a few GFLOP/s. The custom call reads each key and value straight from its page, only those a
query row can see, on XLA's own intra-op threads.

`load()` compiles `cpu.cc` with the system's C++ compiler (`CXX`, else g++) against the FFI headers
that ship with jaxlib, into `~/.cache/jaxserve/kernels` (keyed by the source, jaxlib's version, the
flags and the CPU, since it is built for this CPU), and registers the target with XLA. Without a
compiler it returns False and the caller keeps the XLA implementation.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import jax
import jaxlib
import numpy as np

TARGET = "jaxserve_paged_attention"
SOURCE = Path(__file__).with_name("cpu.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

log = logging.getLogger(__name__)
_loading = threading.Lock()  # step buckets compile on several threads; the library is built once


def _cpu_identity() -> str:
    """What a -march=native build depends on: the CPU's model and instruction sets."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def load() -> bool:
    """Build (once per machine) and register the custom call; False where it cannot be built."""
    with _loading:
        return _load()


@functools.cache
def _load() -> bool:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found (set CXX): CPU attention falls back to the XLA implementation")
        return False
    from checkpoints.default_model import cache_root  # (not at import: checkpoints imports the model, which imports kernels)

    source = SOURCE.read_bytes()
    key = hashlib.sha256(repr((source, jaxlib.__version__, compiler, FLAGS, _cpu_identity())).encode()).hexdigest()
    library = cache_root() / "kernels" / f"paged_attention_cpu-{key[:24]}.so"
    if not library.is_file():
        library.parent.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".tmp{os.getpid()}")
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(partial)]
        try:
            build = subprocess.run(command, capture_output=True, text=True)
            failure = build.stderr[-4000:] if build.returncode else None
        except OSError as e:  # e.g. CXX names no program
            failure = str(e)
        if failure is not None:
            log.warning("building the CPU attention kernel failed (%s): falling back to the XLA implementation\n%s",
                        " ".join(command), failure)
            return False
        partial.replace(library)  # atomic: a concurrent build's reader sees the whole library or none
    handler = ctypes.cdll.LoadLibrary(str(library)).JaxservePagedAttention
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                        sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None):
    """See `reference.paged_attention_reference`; `load()` must have returned True."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0))
