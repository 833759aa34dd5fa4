"""vLLM's start_profile / stop_profile (`LLM`'s methods, the server's POST routes) over JAX's
profiler: a trace of the whole process, its threads and its devices, written under the configured
directory (`ProfilerConfig`) as TensorBoard's profile plugin and Perfetto read it."""

from __future__ import annotations

import os
import threading

import jax

from jaxserve.config.profiler import ProfilerConfig


class Profiler:
    """One trace at a time in a process (JAX's profiler is the process's), whoever starts it."""

    _lock = threading.Lock()
    _running = False

    def __init__(self, config: ProfilerConfig):
        self.directory = config.directory

    def start(self) -> None:
        """ValueError while a trace runs, or where the directory cannot be made (found now, not when
        the trace is written: a trace that cannot be written would leave JAX's profiler running)."""
        with Profiler._lock:
            if Profiler._running:
                raise ValueError("a profile is already being taken: stop it first (stop_profile)")
            try:
                os.makedirs(self.directory, exist_ok=True)
            except OSError as e:
                raise ValueError(f"the profiler's directory {self.directory}: {e.strerror}") from None
            if not os.access(self.directory, os.W_OK):
                raise ValueError(f"the profiler's directory {self.directory} is not writable")
            try:
                jax.profiler.start_trace(self.directory, create_perfetto_trace=True)  # (Perfetto's file too)
            except RuntimeError as e:  # (JAX's profiler started by someone else in this process)
                raise ValueError(f"JAX's profiler: {e}") from None
            Profiler._running = True

    def stop(self) -> None:
        """Write the trace; ValueError where none runs."""
        with Profiler._lock:
            if not Profiler._running:
                raise ValueError("no profile is being taken: start one first (start_profile)")
            Profiler._running = False
            jax.profiler.stop_trace()
