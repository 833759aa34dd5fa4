"""The real server for API tests: Hypercorn on 127.0.0.1 (a free port) in a thread, over jaxserve-tiny."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

MODEL = "jaxserve-tiny"
MAX_MODEL_LEN = 320
# (with a logits processor that the requests of other tests leave unused; max_logprobs -1: requests may
# ask for any number of top logprobs, the whole vocabulary included)
ENGINE = dict(model="jaxserve-tiny", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=64,
              num_pages=64, max_logprobs=-1, logits_processors=("processors:BanToken",))


ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def serving(port: int, *flags: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`python run_server.py` over jaxserve-tiny (with `env` over this process's environment), once
    /health says 200; killed at the end if still running."""
    proc = subprocess.Popen([sys.executable, "run_server.py", "--model", "jaxserve-tiny", "--port", str(port), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=None if env is None else {**os.environ, **env})
    try:
        deadline = time.time() + 240
        while not healthy(proc, port):
            assert time.time() < deadline, "the server did not become healthy"
            time.sleep(0.3)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def healthy(proc: subprocess.Popen, port: int) -> bool:
    assert proc.poll() is None, proc.stdout.read()
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    except httpx.TransportError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Hypercorn serving `app` from a thread with its own event loop."""

    def __init__(self, app, port: int):
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.graceful_timeout = 1.0
        self.app = app
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(serve(app, config, shutdown_trigger=self._stop.wait),),
            daemon=True)
        self._thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("server did not become healthy")

    def stop(self):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def post(served, path: str, body) -> httpx.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(served[0].url + path, content=data, headers={"Content-Type": "application/json"}, timeout=60)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]


def completion(client, **kw):
    return client.completions.create(model=MODEL, **kw)


def streamed_text(client, **kw) -> tuple[str, str | None]:
    """A streamed completion's text and its last finish reason."""
    text, finish = "", None
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish
