"""A disk cache of compiled step executables, so that a restart skips tracing, lowering and compiling.

XLA's persistent compilation cache saves only the last of those three stages; tracing and lowering
the unrolled decoder still cost the bulk of a warm start-up. Here
each bucket's compiled executable is serialized (`jax.experimental.serialize_executable`) under a
key that hashes everything it depends on and that is known without tracing:

- the source of the packages that define the step (`jaxserve`, `jaxserve_kernels`) and the versions of
  jax, jaxlib and flax;
- the backend, its devices, `XLA_FLAGS` and the attention and matmul implementations (resolving
  them also registers the CPU kernels' custom calls, which a loaded executable may call);
- the caller's description (model and engine configs, the bucket) and the shapes, dtypes and
  shardings of the arguments.

Any change gives a new key. An entry that fails to load is compiled again and rewritten.

It replaces XLA's persistent cache rather than sitting beside it: on XLA:CPU, once a process has
loaded an executable from XLA's cache, the executables it compiles next no longer survive
serialization (they fail at run time: "Function ... not found"). So the disk is used only when
XLA's cache is off, and in a single-process job (each process of a multi-host job compiles its own
executables, with XLA's cache, see `compilation_cache`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
from pathlib import Path

import flax
import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxserve_kernels import implementation as attention_implementation
from jaxserve_kernels.cache import cache_root
from jaxserve_kernels.matmul import implementation as matmul_implementation

log = logging.getLogger(__name__)

SOURCE_PACKAGES = ("jaxserve", "jaxserve_kernels")
SOURCE_SUFFIXES = (".py", ".cc", ".h")
MAX_ENTRIES = 256  # beyond this, the least recently used entries are deleted
ENVIRONMENT_VARIABLES = ("XLA_FLAGS", "JAXSERVE_ATTENTION", "JAXSERVE_MATMUL")


def source_files() -> tuple[Path, list[Path]]:
    """(the directory that holds the packages, the source files of SOURCE_PACKAGES in it)."""
    root = Path(__file__).resolve().parents[2]  # (this file is jaxserve/worker/executables.py)
    return root, [f for package in SOURCE_PACKAGES
                  for f in sorted((root / package).rglob("*")) if f.suffix in SOURCE_SUFFIXES]


@functools.cache
def _installation_digest() -> str:
    """What every executable depends on and that does not change while the process runs."""
    h = hashlib.sha256()
    root, files = source_files()
    for file in files:
        h.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")
    backend = jax.devices()[0].client
    h.update(repr((jax.__version__, jaxlib.__version__, flax.__version__, backend.platform,
                   backend.platform_version, [(d.id, d.device_kind) for d in jax.devices()])).encode())
    return h.hexdigest()


def _settings() -> str:
    """What may change while the process runs (read at each compilation: tests switch the attention
    implementation through the environment)."""
    return repr(([os.environ.get(name) for name in ENVIRONMENT_VARIABLES], attention_implementation(),
                 matmul_implementation(), jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision))


def _argument_signature(args) -> str:
    leaves, treedef = jax.tree.flatten(args)
    return repr((str(treedef), [(x.shape, str(x.dtype), str(x.sharding)) for x in leaves]))


def _mtime(path: Path) -> float:
    """0 for a file another thread or process has just removed."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


class ExecutableCache:
    """`compile(fn, args, description, devices)`: `fn` (a jitted function) lowered and compiled for
    `args`, or its executable loaded from `directory` (None: always compile, nothing is written).
    `devices` are the mesh's, in its order: the ones a loaded executable runs on."""

    def __init__(self, directory: Path | None):
        usable = jax.process_count() == 1 and not jax.config.jax_compilation_cache_dir
        self.directory = directory if usable else None

    def compile(self, fn, args: tuple, description: str, devices: list) -> jax.stages.Compiled:
        if self.directory is None:
            return fn.lower(*args).compile()
        path = self.path(args, description, devices)
        if path.is_file():
            try:
                serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
                compiled = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                                     execution_devices=devices)
            except Exception as e:  # a truncated or incompatible entry: compile it again
                log.warning("could not load the cached executable %s (%s); compiling it again", path, e)
            else:
                with contextlib.suppress(OSError):
                    path.touch()  # recently used (see _prune)
                return compiled
        compiled = fn.lower(*args).compile()
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # e.g. a Pallas kernel run by its interpreter holds a Python callback
            log.info("this executable cannot be saved (%s); it will be compiled again next time", e)
            return compiled
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(blob)
            tmp.replace(path)  # atomic: a concurrent reader sees the whole file or none
            self._prune()
        except OSError as e:  # e.g. a read-only cache directory
            log.warning("could not save the executable to %s: %s", path, e)
        return compiled

    def path(self, args: tuple, description: str, devices: list) -> Path:
        # (an executable loads only onto the devices it was compiled for: each data-parallel replica has its own)
        key = hashlib.sha256(f"{_installation_digest()}\0{_settings()}\0{description}\0{_argument_signature(args)}"
                             f"\0{[d.id for d in devices]}".encode())
        return self.directory / f"{key.hexdigest()}.executable"

    def _prune(self) -> None:
        entries = sorted(self.directory.glob("*.executable"), key=_mtime)
        for stale in entries[:max(0, len(entries) - MAX_ENTRIES)]:
            stale.unlink(missing_ok=True)


def compilation_cache() -> ExecutableCache:
    """What makes a restart fast: in one process, the cache of compiled step executables
    (`executables.py`); across processes, XLA's persistent compilation cache. Not both (see there)."""
    if jax.process_count() > 1 and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(cache_root() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return ExecutableCache(cache_root() / "executables")
