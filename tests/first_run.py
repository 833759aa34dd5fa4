"""A new user's first run: `python run_server.py` on the default model, checked from outside.

    python tests/first_run.py                     # with this interpreter, in the current environment
    python tests/first_run.py --block torch       # torch made unimportable in the server's process

Starts the server, waits for `/health` 200, asks the README's France question greedily (the answer
must contain "Paris"), fetches the playground (`GET /` 200), then sends SIGTERM and expects exit
code 0. Prints the server's output with each line's seconds since the start, and a timeline.
The standard library only: `.ci/run` runs it in a virtual environment made by `pip install .`
(no extras), with an empty HOME; `tests/test_first_run.py` runs it with torch blocked.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "What is the capital of France? Answer in one word."
# run_server.py as `python run_server.py ARGS` runs it, after making the modules named unimportable:
# None in sys.modules makes `import` raise ModuleNotFoundError and `importlib.util.find_spec` answer
# None, as where the package is not installed
LAUNCH = ("import runpy, sys\nfor name in {blocked!r}: sys.modules[name] = None\n"
          "sys.argv = ['run_server.py', *sys.argv[1:]]\nrunpy.run_path('run_server.py', run_name='__main__')\n")


def request(url: str, body: dict | None = None, timeout: float = 5) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_run(port: int, blocked: list[str], server_args: list[str], timeout: float) -> dict:
    """The timeline of one first run (seconds since the start); AssertionError, with the server's
    output, where a check fails."""
    started, port = time.monotonic(), port or free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH.format(blocked=blocked), "--port", str(port), *server_args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(f"{time.monotonic() - started:7.1f}s {line}"
                                                          for line in proc.stdout), daemon=True)
    reader.start()
    url, marks = f"http://127.0.0.1:{port}", {}
    try:
        deadline = started + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, "the server exited before /health answered 200"
            try:
                if request(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError(f"/health did not answer 200 within {timeout:.0f} s")
        marks["health_200_s"] = time.monotonic() - started
        status, body = request(url + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 16}, timeout=120)
        answer = json.loads(body)["choices"][0]["message"]["content"] if status == 200 else body.decode()
        assert status == 200 and "Paris" in answer, (status, answer)
        marks["first_answer_s"] = time.monotonic() - started
        status, page = request(url + "/")
        assert status == 200 and b"<html" in page.lower(), (status, page[:200])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, f"exit code {proc.returncode} after SIGTERM"
        marks["stopped_s"] = time.monotonic() - started
        return marks
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the server's output:\n{''.join(lines)}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
        sys.stdout.write("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    parser.add_argument("--block", action="append", default=[], help="a package made unimportable (repeatable)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds /health may take to answer 200")
    parser.add_argument("server_args", nargs="*", help="flags for run_server.py (after --)")
    args = parser.parse_args()
    print(json.dumps(first_run(args.port, args.block, args.server_args, args.timeout)))


if __name__ == "__main__":
    main()
