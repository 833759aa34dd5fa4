"""Compiling the step buckets before and while the engine serves.

A step runs only a bucket already compiled (`Runner.shape`, within `Runner.token_budget`), so
serving never compiles; `EngineConfig.warmup` says how many are compiled before the first step:

- all: every bucket (the offline LLM's default), with a progress bar;
- minimal: the first of `EngineConfig.warmup_order`, which runs any step (run_server.py's
  default). The others compile on background threads in that order, each one letting the steps
  that follow take more tokens or run in a smaller bucket.

`BucketCompiler` compiles (or loads from the executable cache) several buckets at once: XLA
compiles and loads without holding the GIL. The first bucket compiles alone, since the server
waits for it: tracing and lowering hold the GIL, and a second thread's would slow them (figures
in bench/RESULTS.md). Its threads are daemons, so a process may end while they work; `close`
(also run at exit) lets each finish its bucket first, since a thread cut off inside XLA at
interpreter shutdown can abort the process.

The buckets compiled while the engine serves stay out of its way: their threads run at the lowest
OS priority (the step's threads get the cores first), and while they work the interpreter hands the
GIL over every BACKGROUND_SWITCH_INTERVAL_S instead of every 5 ms (a step waiting for the GIL that a
tracing thread holds waits that long at each handover). Figures in bench/RESULTS.md.

Linux allows a process vm.max_map_count memory maps (65530 by default), and XLA:CPU maps three for
each compiled kernel, hundreds per bucket; past the limit, loading or compiling the next one
crashes the process. Below MAP_RESERVE maps to spare, the buckets left are not compiled (steps do
without them, as without one that failed) and the log says how to raise the limit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from jaxserve.errors import WarmupCancelled
from jaxserve.worker.runner import Runner

log = logging.getLogger(__name__)

WARMUP_THREADS = min(4, os.cpu_count() or 1)  # buckets compiled (or loaded) at once
CLOSE_TIMEOUT_S = 120.0  # at most this long to wait for the buckets being compiled when closing
BACKGROUND_SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while buckets compile in the background
LOWEST_PRIORITY = 19  # a background compile thread's nice value
MAP_RESERVE = 4096  # memory maps left for what follows the last bucket compiled (see the top)


class MapsExhausted(MemoryError):
    """Too few memory maps left to compile another bucket safely (see the top)."""


def map_headroom() -> int | None:
    """How many more memory maps Linux lets this process create (None where /proc does not say)."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps", "rb") as maps:
            return limit - sum(1 for _ in maps)
    except (OSError, ValueError):
        return None


def _lowest_priority() -> None:
    """This thread at the lowest OS priority (on Linux a thread has a nice value of its own; elsewhere
    nothing changes)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)


class BucketCompiler:
    """Compiles `shapes` in order, `threads` at a time, from `start` on; `wait` returns once the
    first n of them are compiled."""

    def __init__(self, runner: Runner, shapes: tuple[tuple[int, int, int], ...], threads: int = WARMUP_THREADS):
        self.runner = runner
        self.shapes = shapes
        self.threads = threads
        self._todo: queue.SimpleQueue = queue.SimpleQueue()  # shapes no thread has taken yet
        self._changed = threading.Condition()  # notified as each bucket is done, and at close
        self._compiled: set[tuple[int, int, int]] = set()
        self._failed: dict[tuple[int, int, int], BaseException] = {}
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._started_at = 0.0
        self._log_progress = False
        self._background = False
        self._switch_interval: float | None = None  # the interpreter's, while background compiles change it

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def start(self, log_progress: bool = False, background: bool = False) -> None:
        """Start compiling; `log_progress`: a log line at each quarter (where no progress bar shows it);
        `background`: the buckets after the first compile while the engine serves (see the top)."""
        if self._workers:
            return
        self._log_progress = log_progress
        self._background = background
        self._started_at = time.monotonic()
        for shape in self.shapes:
            self._todo.put(shape)
        atexit.register(self.close)
        self._add_worker()  # (the others once the first bucket is compiled)

    def _add_worker(self) -> None:
        worker = threading.Thread(target=self._work, name=f"jaxserve-compile-{len(self._workers)}", daemon=True)
        worker.start()
        self._workers.append(worker)

    def wait(self, n: int, progress: bool = False) -> None:
        """Block until the first n shapes are compiled (with a progress bar where `progress`);
        raises the error of one that failed, or WarmupCancelled once closed."""
        first = self.shapes[:n]
        with tqdm(total=n, desc="compiling step buckets", disable=not progress) as bar, self._changed:
            while not all(s in self._compiled for s in first):
                failed = next((s for s in first if s in self._failed), None)
                if failed is not None:
                    raise RuntimeError(f"compiling the step for bucket {failed} failed") from self._failed[failed]
                if self._closed:
                    raise WarmupCancelled("the engine stopped before its steps were compiled")
                self._changed.wait()
                bar.update(sum(s in self._compiled for s in first) - bar.n)

    def _work(self) -> None:
        while not self._closed:
            try:
                shape = self._todo.get_nowait()
            except queue.Empty:
                return
            if self._background and shape != self.shapes[0]:
                self._in_background()
            try:
                self._check_map_headroom()
                self.runner.compile(shape)
            except MapsExhausted as e:  # (said once: every bucket left fails alike)
                with self._changed:
                    first = not any(isinstance(f, MapsExhausted) for f in self._failed.values())
                    self._failed[shape] = e
                if first:
                    log.warning("step bucket %s and those after it are not compiled: %s", shape, e)
                failed = e
            except Exception as e:  # (a bucket the steps must do without: said now, raised by `wait`)
                log.exception("compiling the step for bucket %s failed", shape)
                failed = e
            else:
                failed = None
            with self._changed:
                if failed is None:
                    self._compiled.add(shape)
                else:
                    self._failed[shape] = failed
                self._changed.notify_all()
                compiled, failures = len(self._compiled), len(self._failed)
                done = compiled + failures
            if shape == self.shapes[0] and not self._closed:
                for _ in range(min(self.threads, len(self.shapes)) - 1):
                    self._add_worker()
            if done == len(self.shapes):
                self._finish()
            elif self._log_progress and done * 4 // len(self.shapes) > (done - 1) * 4 // len(self.shapes):
                log.info("%d of %d step buckets compiled%s", compiled, len(self.shapes),
                         f" ({failures} failed)" if failures else "")

    def _check_map_headroom(self) -> None:
        """Raises, once memory maps run short, rather than compile into a crash (see the top)."""
        headroom = map_headroom()
        if headroom is not None and headroom < MAP_RESERVE:
            raise MapsExhausted(f"only {headroom} memory maps are left to this process under Linux's "
                              "vm.max_map_count, and XLA maps three for each compiled kernel: raise the limit "
                              "(sysctl -w vm.max_map_count=262144) to compile every step bucket")

    def _in_background(self) -> None:
        """This thread compiles while the engine may serve (see the top)."""
        _lowest_priority()
        with self._changed:
            if self._switch_interval is None:
                self._switch_interval = sys.getswitchinterval()
                sys.setswitchinterval(BACKGROUND_SWITCH_INTERVAL_S)

    def _restore_switch_interval(self) -> None:
        with self._changed:
            if self._switch_interval is not None:
                sys.setswitchinterval(self._switch_interval)
                self._switch_interval = None

    def _finish(self) -> None:
        self._restore_switch_interval()
        atexit.unregister(self.close)  # (which holds the runner, its weights and its cache)
        took = time.monotonic() - self._started_at
        if self._failed:
            log.warning("%d of %d step buckets compiled in %.1f s; steps do without the %d that failed",
                        len(self._compiled), len(self.shapes), took, len(self._failed))
        else:
            log.info("every step bucket is compiled (%d in %.1f s)", len(self.shapes), took)

    def close(self) -> None:
        """Take no more buckets; wait for those being compiled."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join(CLOSE_TIMEOUT_S)
        self._restore_switch_interval()
        atexit.unregister(self.close)
