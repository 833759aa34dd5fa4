"""Building the CPU kernels: C++ XLA FFI custom calls, compiled on first use with the system compiler.

`register(source, symbol, target)` compiles one kernel's `.cc` (which includes `common.h`) with
`CXX` (else g++) against the FFI headers that ship with jaxlib, into `~/.cache/jaxserve/kernels`,
keyed by the sources (the `.cc`, `common.h` and the headers beside the `.cc`), jaxlib's version,
the compiler, the flags and the CPU (it is built for this CPU with -march=native), loads it and
registers its handler as an XLA:CPU custom call (`library(source)`: the loaded library itself).
Without a compiler, or when the build fails, it returns False (None) and the caller keeps its XLA
implementation.
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

from jaxserve_kernels.cache import cache_root

COMMON = Path(__file__).with_name("common.h")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")

log = logging.getLogger(__name__)
_building = threading.Lock()  # step buckets compile on several threads; each library is built once


def _cpu_identity() -> str:
    """What a -march=native build depends on: the CPU's model and instruction sets."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def register(source: Path, symbol: str, target: str) -> bool:
    """Build `source` (once per machine) and register its handler `symbol` as the XLA:CPU custom
    call `target` (once per process); False where it cannot be built."""
    with _building:
        return _register(source, symbol, target)


def library(source: Path) -> ctypes.CDLL | None:
    """`source` built (once per machine) and loaded (once per process); None where it cannot be built."""
    with _building:
        return _library(source)


@functools.cache
def _register(source: Path, symbol: str, target: str) -> bool:
    lib = _library(source)
    if lib is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


@functools.cache
def _library(source: Path) -> ctypes.CDLL | None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    name = f"{source.parent.name}/{source.name}"
    if compiler is None:
        log.warning("no C++ compiler found (set CXX): %s falls back to its XLA implementation", name)
        return None
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # the ones it may include
    key = hashlib.sha256(repr((source.read_bytes(), COMMON.read_bytes(), headers, jaxlib.__version__, compiler, FLAGS,
                               _cpu_identity())).encode()).hexdigest()
    path = cache_root() / "kernels" / f"{source.parent.name}_{source.stem}-{key[:24]}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".tmp{os.getpid()}")
        log.info("building the CPU kernel %s (once: kept in %s)", name, path.parent)
        command = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{COMMON.parent}", str(source), "-o",
                   str(partial)]
        try:
            build = subprocess.run(command, capture_output=True, text=True)
            failure = build.stderr[-4000:] if build.returncode else None
        except OSError as e:  # e.g. CXX names no program
            failure = str(e)
        if failure is not None:
            log.warning("building %s failed (%s): it falls back to its XLA implementation\n%s", name,
                        " ".join(command), failure)
            return None
        partial.replace(path)  # atomic: a concurrent build's reader sees the whole library or none
    return ctypes.cdll.LoadLibrary(str(path))
