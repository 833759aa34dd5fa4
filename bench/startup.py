"""Start-up time: from `python run_server.py` starting to its first answered chat completion.

    python bench/startup.py --model DIR                    # cold (an empty cache), then warm
    python bench/startup.py --model DIR --root ../wt-base  # another checkout's server, for a before/after
    python bench/startup.py --model DIR -- --max-model-len 2048   # flags after -- go to the server
    python bench/startup.py --model smollm2-135m-instruct --serve-early   # W1, W2 as soon as /health is 200

"Cold" runs with XDG_CACHE_HOME set to an empty directory: no compiled executables, no built CPU
kernels, and (for the built-in model) no jaxserve-tiny on disk, as on a fresh machine. "Warm" runs
again with the same directory. From the moment the process starts, the client sends a chat
completion until one comes back (a refused connection is retried; a request sent while the server
warms up may wait for it), and polls /health. Prints one JSON object per run: seconds to the port
answering, to /health answering 200, to the first completion, and to the log line saying every
step bucket is compiled (null where the server compiles all before it listens).

With --serve-early, each run also sends bench/loadgen.py's W1 then W2 the moment /health answers
200 (while the other buckets compile in the background), and again once every bucket is compiled
(steady state), and prints both with their ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from loadgen import workload

ROOT = Path(__file__).resolve().parent.parent
# the server's log lines (jaxserve/worker/warmup.py, engine.py)
ALL_COMPILED, BACKGROUND = "every step bucket is compiled", "the others compile in the background"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_output(proc: subprocess.Popen, started: float, marks: dict, lines: list) -> None:
    """Keep the server's output (for a failure's report) and note when every bucket is compiled."""
    for line in proc.stdout:
        lines.append(line)
        if ALL_COMPILED in line and "all_compiled_s" not in marks:
            marks["all_compiled_s"] = time.monotonic() - started


def _watch_health(url: str, started: float, marks: dict, done: threading.Event) -> None:
    """Note when the port first answers, and when /health first answers 200."""
    with httpx.Client(timeout=5) as client:
        while not done.is_set() and "health_s" not in marks:
            try:
                status = client.get(url + "/health").status_code
            except httpx.TransportError:
                status = None
            now = time.monotonic() - started
            if status is not None:
                marks.setdefault("listening_s", now)
            if status == 200:
                marks["health_s"] = now
            time.sleep(0.1)


def _complete(client: httpx.Client, url: str) -> bool:
    """One chat completion; True once one came back (a request sent before the server is ready may
    wait for it: as a client that does not poll /health would)."""
    try:
        r = client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello there!"}], "max_tokens": 8})
    except httpx.TransportError:
        return False
    return r.status_code == 200


def _serve_workloads(url: str, model: str) -> dict:
    """W1 then W2 (bench/loadgen.py) against the served model: W1's decode tok/s and TTFT, W2's tok/s."""
    w1 = asyncio.run(workload(url, "W1", model, offset=20_000))
    w2 = asyncio.run(workload(url, "W2", model, offset=20_000))
    return {"w1_decode_tok_s": w1["decode_tok_s"], "w1_ttft_ms": 1000 * w1["ttft_p50"], "w2_tok_s": w2["output_tok_s"]}


def run_once(root: Path, model: str | None, cache: Path, server_args: list[str], timeout: float,
             wait_all: bool, serve_early: bool = False) -> dict:
    """Start the server of checkout `root`, time it, stop it."""
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(root)}
    cmd = [sys.executable, "run_server.py", "--port", str(port), "--disable-log-stats", *server_args]
    if model:
        cmd += ["--model", model]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks, lines = {}, []
    reader = threading.Thread(target=_read_output, args=(proc, started, marks, lines), daemon=True)
    reader.start()
    url, done = f"http://127.0.0.1:{port}", threading.Event()
    watcher = threading.Thread(target=_watch_health, args=(url, started, marks, done), daemon=True)
    watcher.start()
    try:
        if serve_early:
            while "health_s" not in marks:
                if proc.poll() is not None or time.monotonic() - started > timeout:
                    raise SystemExit("the server did not turn healthy:\n" + "".join(lines[-40:]))
                time.sleep(0.05)
            marks["early"] = _serve_workloads(url, model or "")
            wait_all = True
        with httpx.Client(timeout=timeout) as client:
            while not _complete(client, url):
                if proc.poll() is not None or time.monotonic() - started > timeout:
                    raise SystemExit("the server did not answer:\n" + "".join(lines[-40:]))
                time.sleep(0.2)
            marks["first_completion_s"] = time.monotonic() - started
            wait_all = wait_all and any(BACKGROUND in line for line in lines)
            while wait_all and "all_compiled_s" not in marks and time.monotonic() - started < timeout:
                time.sleep(0.5)
            if serve_early:
                marks["steady"] = _serve_workloads(url, model or "")
                marks["early_over_steady"] = {k: marks["early"][k] / marks["steady"][k] for k in marks["steady"]}
    finally:
        done.set()
        proc.terminate()
        proc.wait(60)
        reader.join(10)
        watcher.join(10)
    marks.setdefault("all_compiled_s", None)
    return marks


def _rounded(marks: dict) -> dict:
    return {k: _rounded(v) if isinstance(v, dict) else None if v is None else round(v, 2) for k, v in marks.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="jaxserve-tiny", help="the server's --model (default: the built-in jaxserve-tiny)")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose run_server.py runs")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="XDG_CACHE_HOME of the runs (default: a new empty directory, removed afterwards)")
    p.add_argument("--warm-runs", type=int, default=1, help="warm restarts after the cold start")
    p.add_argument("--no-cold", action="store_true", help="only warm runs (with --cache-dir filled before)")
    p.add_argument("--wait-all", action="store_true",
                   help="keep a server that compiles in the background up until it logs that every bucket is "
                        "compiled (or --timeout)")
    p.add_argument("--serve-early", action="store_true",
                   help="W1 and W2 as soon as /health answers 200, and again once every bucket is compiled")
    p.add_argument("--timeout", type=float, default=1800.0)
    args, server_args = p.parse_known_args()
    server_args = [a for a in server_args if a != "--"]
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="jaxserve-startup-"))
    try:
        revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.root, capture_output=True,
                                  text=True).stdout.strip()
        runs = ([] if args.no_cold else ["cold"]) + ["warm"] * args.warm_runs
        for kind in runs:
            marks = run_once(args.root.resolve(), args.model, cache, server_args, args.timeout, args.wait_all,
                             args.serve_early)
            print(json.dumps({"run": kind, "revision": revision, "model": args.model,
                              "server_args": server_args, **_rounded(marks)}), flush=True)
    finally:
        if args.cache_dir is None:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
