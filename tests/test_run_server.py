"""`python run_server.py` as users run it: flags, readiness, and a clean stop on SIGINT / SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_stops_cleanly_with_a_stream_in_flight(sig, tmp_path):
    port = free_port()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    proc = subprocess.Popen(
        [sys.executable, "run_server.py", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--served-model-name", "tiny", "--api-key", "k", "--seed", "1",
         "--chat-template", str(template), "--log-level", "warning", "--kv-cache-memory-fraction", "0.01"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer k"}
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        r = httpx.post(url + "/v1/chat/completions", headers=auth, timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert r.json()["usage"]["prompt_tokens"] == len("[user] hi\n[assistant] ")  # the --chat-template
        assert httpx.get(url + "/v1/models").status_code == 401

        started = threading.Event()

        def stream():
            try:
                with httpx.stream("POST", url + "/v1/completions", headers=auth, timeout=30, json={
                        "prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}) as s:
                    for _ in s.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass  # the server went away mid-stream: expected

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        reader.join(30)
        assert proc.returncode == 0, out
        assert f"listening on http://127.0.0.1:{port}" in out and "jaxserve: stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_vllm_flag_names():
    """vLLM's names for jaxserve's flags, and its flags for the KV cache's type and tool choice."""
    sys.path.insert(0, str(ROOT))
    from run_server import parse_args

    args = parse_args(["--block-size", "32", "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "bfloat16",
                       "--dtype", "auto", "--enable-auto-tool-choice", "--trust-remote-code"])
    assert (args.page_size, args.kv_cache_memory_fraction, args.kv_cache_dtype) == (32, 0.5, "bfloat16")
    assert args.dtype == "auto" and args.enable_auto_tool_choice
    assert not parse_args(["--no-enable-auto-tool-choice"]).enable_auto_tool_choice
    assert parse_args(["--enable-log-requests"]).enable_log_requests
    assert not parse_args(["--disable-log-requests"]).enable_log_requests
    assert parse_args(["--tokenizer", "/tok"]).tokenizer == "/tok"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp8"])
