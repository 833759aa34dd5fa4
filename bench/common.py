"""What every benchmark script shares: the machine line, free ports, a server started and stopped."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def machine_line() -> str:
    return f"{time.strftime('%Y-%m-%d')}, {cpu_model()} ({os.cpu_count()} cores)"


def write_between(markers: tuple[str, str], table: str) -> None:
    """Put `table` into bench/RESULTS.md between its `markers` (the section's start and end comments)."""
    path = ROOT / "bench" / "RESULTS.md"
    text = path.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    path.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_compiled(url: str, deadline: float) -> None:
    """Until /metrics' jaxserve:step_buckets_compiled reaches jaxserve:step_buckets (at once for a
    server without them: another server, or a jaxserve revision that compiled all before listening)."""
    while time.perf_counter() < deadline:
        try:
            text = httpx.get(url + "/metrics", timeout=5).text
        except httpx.TransportError:
            return
        gauges = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("jaxserve:step_buckets"))
        if len(gauges) < 2 or gauges["jaxserve:step_buckets_compiled"] == gauges["jaxserve:step_buckets"]:
            return
        time.sleep(1.0)


@contextlib.contextmanager
def server(cmd: list[str], port: int, *, ready_path: str = "/health", timeout: float = 1800, log: Path | None = None,
           env: dict | None = None, cwd: Path = ROOT):
    """Start `cmd` (a server listening on `port`) in `cwd`, wait until `ready_path` answers 200, yield
    its URL and the seconds it took to become ready; stop it on exit. A jaxserve that compiles step
    buckets in the background once ready is waited for until all are compiled (not counted in the
    seconds): the workloads measure the steps, not the compiler beside them."""
    out = open(log, "w") if log else subprocess.DEVNULL
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}" + (f"; see {log}" if log else ""))
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"{cmd[0]} not ready after {timeout} s")
            try:
                if httpx.get(url + ready_path, timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        ready = time.perf_counter() - start
        _wait_compiled(url, start + timeout)
        yield url, ready
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()
