"""`python run_server.py` as users run it: flags, readiness, and a clean stop on SIGINT / SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import pytest
import trustme
from server import free_port, serving

from jaxserve import host_memory
from jaxserve_kernels import implementation as attention_implementation

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sig,https", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_serves_then_stops_cleanly_with_a_stream_in_flight(sig, https, tmp_path):
    """The stream in flight ends with [DONE] (cut by the model's max_new_tokens, or aborted at once:
    --shutdown-timeout 0, the default), the process exits 0. Also: HTTPS with --ssl-keyfile /
    --ssl-certfile, and the stats line while busy."""
    port = free_port()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    flags, client = [], httpx.Client(timeout=30)
    if https:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
        cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
        flags = ["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile", str(tmp_path / "cert.pem")]
        context = ssl.create_default_context()
        ca.configure_trust(context)
        client = httpx.Client(timeout=30, verify=context)
    proc = subprocess.Popen(
        [sys.executable, "run_server.py", "--model", "jaxserve-tiny", "--port", str(port), "--max-model-len", "128", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "32", "--served-model-name", "tiny", "--api-key", "k", "--seed", "1",
         "--chat-template", str(template), "--log-level", "info", "--kv-cache-memory-fraction", "0.01",
         "--log-stats-interval", "0.2", "--max-logprobs", "3", "--enforce-eager", "--swap-space", "4",
         "--override-generation-config", '{"max_new_tokens": 7}', "--logits-processors", "tests.processors:BanToken",
         *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"{'https' if https else 'http'}://127.0.0.1:{port}"
    auth = {"Authorization": "Bearer k"}
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        r = client.post(url + "/v1/chat/completions", headers=auth, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert r.json()["usage"]["prompt_tokens"] == len("[user] hi\n[assistant] ")  # the --chat-template
        assert client.get(url + "/v1/models").status_code == 401
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # (the same process, run again where it preloads)
        assert ("tcmalloc" in maps) == (host_memory.tcmalloc_to_preload() is not None)
        r = client.post(url + "/v1/completions", headers=auth, json={"prompt": "x", "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 7  # --override-generation-config's max_new_tokens
        r = client.post(url + "/v1/completions", headers=auth, json={"prompt": "x", "logprobs": 4})
        assert r.status_code == 400 and "max_logprobs (3)" in r.json()["error"]["message"]
        r = client.post(url + "/v1/completions", headers=auth, json={  # (--logits-processors)
            "prompt": "x", "max_tokens": 7, "ignore_eos": True, "temperature": 0, "return_token_ids": True})
        banned = r.json()["choices"][0]["token_ids"][0]
        r = client.post(url + "/v1/completions", headers=auth, json={
            "prompt": "x", "max_tokens": 7, "ignore_eos": True, "temperature": 0, "return_token_ids": True,
            "vllm_xargs": {"ban_token": banned}})
        assert banned not in r.json()["choices"][0]["token_ids"]
        if https:
            with pytest.raises(httpx.TransportError):  # TLS or nothing
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)

        started, lines = threading.Event(), []

        def stream():
            with client.stream("POST", url + "/v1/completions", headers=auth, json={
                    "prompt": "x", "max_tokens": 120, "stream": True, "ignore_eos": True}) as s:
                for line in s.iter_lines():
                    lines.append(line)
                    started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        time.sleep(0.5)  # a few stats lines (every 0.2 s here)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        reader.join(30)
        assert proc.returncode == 0, out
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "abort")
        assert f"listening on {url}" in out and "jaxserve: stopped" in out
        assert "Avg generation throughput: " in out  # the stats line
    finally:
        if proc.poll() is None:
            proc.kill()


def test_health_says_503_while_the_first_bucket_compiles_and_the_rest_compile_whileserving(tmp_path):
    """A cold start (an empty cache: no compiled steps, no CPU kernels): the server listens while its
    engine compiles its first step bucket, /health answers 503 meanwhile and a request sent then
    waits; then /health answers 200, the request is served, and the other buckets compile in the
    background (the /metrics gauges, a log line when all are)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "run_server.py", "--model", "jaxserve-tiny", "--port", str(port), "--max-model-len", "128",
         "--max-num-seqs", "2",
         "--max-num-batched-tokens", "16"],
        cwd=ROOT, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    url, statuses, early = f"http://127.0.0.1:{port}", [], None
    try:
        with ThreadPoolExecutor(1) as pool:
            deadline = time.time() + 300
            while time.time() < deadline and 200 not in statuses:
                assert proc.poll() is None, proc.stdout.read()
                try:
                    r = httpx.get(url + "/health", timeout=30)
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                statuses.append(r.status_code)
                if r.status_code == 503 and early is None:
                    assert "warming up" in r.json()["error"]
                    early = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                                        timeout=300)
            assert statuses[0] == 503 and statuses[-1] == 200, statuses
            assert early.result().status_code == 200 and early.result().json()["usage"]["completion_tokens"] == 3
        while time.time() < deadline:
            # (30 s, as /health's: a bucket's tracing holds the GIL for a while, longer on a loaded machine)
            metrics = dict(line.rsplit(" ", 1) for line in httpx.get(url + "/metrics", timeout=30).text.splitlines()
                           if line.startswith("jaxserve:step_buckets"))
            if metrics["jaxserve:step_buckets_compiled"] == metrics["jaxserve:step_buckets"]:
                break
            time.sleep(0.5)
        # tokens 1, 4, 16 x page tables of 8 pages (and 4, where the attention reads the whole table)
        widths = 1 if attention_implementation() == "cpu" else 2
        assert float(metrics["jaxserve:step_buckets"]) == 3 * widths, metrics
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "ready to serve" in out and "every step bucket is compiled" in out
        # a clean first run: Hypercorn's lines once each, no jax info line (that libtpu.so is missing)
        assert out.count("Running on") == 1 and "libtpu" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()


# transformers' own test of whether PyTorch is installed, made to find none (it is here, for the tests)
HIDE_TORCH = ("import importlib.util\n"
              "find_spec = importlib.util.find_spec\n"
              "importlib.util.find_spec = lambda name, package=None: "
              "None if name.partition('.')[0] == 'torch' else find_spec(name, package)\n")


def test_loading_the_tokenizer_says_nothing_about_pytorch():
    """Where torch is not installed, importing transformers warns that PyTorch was not found: jaxserve
    needs none, and a newcomer's first run should not show what reads like an error."""
    load = "from checkpoints import default_model_dir\nfrom jaxserve.engine.tokenizer import Tokenizer\nTokenizer(default_model_dir())"
    out = subprocess.run([sys.executable, "-c", HIDE_TORCH + load], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "PyTorch" not in out.stderr + out.stdout, out.stderr
    # (and without jaxserve's filter, transformers does warn: the test hides torch as it should)
    out = subprocess.run([sys.executable, "-c", HIDE_TORCH + "import transformers"], cwd=ROOT, capture_output=True,
                         text=True)
    assert "PyTorch was not found" in out.stderr


FREEZE_HEAP = """
import gc, weakref, run_server
startup = [[] for _ in range(1000)]
run_server.freeze_heap()
assert gc.get_freeze_count() > len(startup)
full = gc.get_stats()[2]["collections"]
class Cycle: pass
for _ in range(300_000):
    c = Cycle(); c.me = c
ref = weakref.ref(c); del c
assert gc.get_stats()[2]["collections"] > full, "no full collection of what came after the freeze"
gc.collect()
assert ref() is None
"""


def test_the_start_up_heap_is_frozen_and_what_comes_after_is_still_collected():
    """`freeze_heap` (before serving): a full collection no longer walks start-up's objects, which held every
    thread, the event loop's too; the garbage made afterwards still gets full collections of its own."""
    out = subprocess.run([sys.executable, "-c", FREEZE_HEAP], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


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
    assert parse_args(["--disable-log-stats"]).disable_log_stats and not parse_args([]).disable_log_stats
    assert parse_args(["--trust-request-chat-template"]).trust_request_chat_template
    args = parse_args(["--max-request-body-bytes", "1024", "--chat-template-timeout", "2.5"])
    assert (args.max_request_body_bytes, args.chat_template_timeout) == (1024, 2.5)
    assert parse_args(["--served-model-name", "a", "b"]).served_model_name == ["a", "b"]
    assert parse_args(["--tool-call-parser", "llama3_json"]).tool_call_parser == "llama3_json"
    assert parse_args([]).tool_call_parser is None  # (the chat template's family)
    assert parse_args([]).logprobs_mode == "raw_logprobs"
    assert parse_args(["--logprobs-mode", "processed_logprobs"]).logprobs_mode == "processed_logprobs"
    args = parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    assert args.allowed_origins == ["https://a.example"] and args.allow_credentials and args.allowed_methods == ["*"]
    args = parse_args(["--enable-chunked-prefill", "--disable-custom-all-reduce", "--max-logprobs", "5",
                       "--override-generation-config", '{"temperature": 0.5}'])
    assert args.max_logprobs == 5 and args.override_generation_config == {"temperature": 0.5}
    # vLLM's own command lines: the model as `vllm serve MODEL` takes it, short flags, flags at the
    # values that leave them off; other values of those are refused with a reason
    args = parse_args(["/models/m", "-tp", "2", "-pp", "1", "--load-format", "safetensors", "--hf-overrides", "{}",
                       "--quantization", "None", "--revision", "main", "--enforce-eager", "--async-scheduling",
                       "--distributed-executor-backend", "mp"])
    assert args.model == "/models/m" and args.tensor_parallel_size == 2 and args.quantization is None
    assert parse_args(["m", "--model", "m"]).model == "m" and parse_args([]).model is None
    args = parse_args(["--return-tokens-as-token-ids", "--response-role", "bot", "--enable-force-include-usage",
                       "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--uvicorn-log-level", "trace",
                       "--reasoning-parser", "qwen3"])
    assert args.return_tokens_as_token_ids and args.response_role == "bot" and args.enable_force_include_usage
    assert args.reasoning_parser == "qwen3" and args.uvicorn_log_level == "trace"
    for wrong in (["--override-generation-config", "[1]"], ["--kv-cache-dtype", "fp8"],
                  ["--allowed-origins", "https://a.example"], ["--logprobs-mode", "x"],
                  ["--ssl-keyfile", "key.pem"], ["--ssl-ca-certs", "ca.pem"], ["--log-stats-interval", "0"],
                  ["--ssl-cert-reqs", "3"], ["a", "--model", "b"], ["--quantization", "awq"], ["-pp", "2"],
                  ["--lora-modules", "a=/x"], ["--enable-lora", "--lora-modules", "a"], ["--max-loras", "0"],
                  ["--enable-lora", "--batch-invariant"], ["--speculative-config", '{"method": "ngram"}'],
                  ["--task", "embed"],
                  ["--tool-call-parser", "xml"], ["--max-request-body-bytes", "0"], ["--chat-template-timeout", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(wrong)


def test_a_lost_kv_cache_fails_its_request_turns_health_503_and_exits_non_zero():
    """docs/api.md's fatal path: a step that fails on the device leaves the (donated) KV cache holding
    the error, so the engine cannot step at all: the request gets a 500, /health stops answering 200,
    and the process exits non-zero, saying why."""
    port = free_port()
    with serving(port, "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                  "--logits-processors", "tests.processors:FailOnDevice") as proc:
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": "hi", "max_tokens": 4, "vllm_xargs": {"fail_on_device": True}})
        assert r.status_code == 500 and "injected device failure" in r.json()["error"]["message"], r.text
        statuses = []
        while proc.poll() is None and len(statuses) < 300:
            try:
                statuses.append(httpx.get(url + "/health", timeout=5).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=60)
    assert 200 not in statuses, statuses
    assert proc.returncode not in (0, None) and "the engine cannot step: its KV cache is lost" in out, out[-3000:]


def test_a_burst_past_the_queue_then_priorities_under_load_then_a_drain_that_finishes_every_stream():
    """One seat, a queue of two: of a burst, two wait and the rest get 503 + Retry-After, and the
    admitted all complete. Under the priority policy a waiting request of a higher priority (lower
    value) preempts the running one and finishes first. SIGTERM with --shutdown-timeout: /health and new
    requests get 503 at once, both streams in flight finish with [DONE], the process exits 0."""
    port = free_port()
    with serving(port, "--max-model-len", "512", "--max-num-seqs", "1", "--max-num-batched-tokens", "32",
                  "--max-num-queued-reqs", "2", "--scheduling-policy", "priority", "--shutdown-timeout", "120") as proc:
        url, client = f"http://127.0.0.1:{port}", httpx.Client(timeout=120)
        done: list[str] = []

        def stream(name: str, started: threading.Event | None = None, **body) -> list[dict]:
            """A streamed completion's chunks (after [DONE])."""
            chunks = []
            with client.stream("POST", url + "/v1/completions", json={
                    "prompt": "x", "stream": True, "ignore_eos": True, **body}) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    if started is not None:
                        started.set()
                    if line == "data: [DONE]":
                        done.append(name)
                        return chunks
                    if line.startswith("data: "):
                        chunks.append(json.loads(line[len("data: "):]))
            raise AssertionError(f"{name}: the stream ended without [DONE]")

        def finish_reason(chunks: list[dict]) -> str:
            return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]][-1]

        with ThreadPoolExecutor(8) as pool:
            started = threading.Event()
            running = pool.submit(stream, "running", started, max_tokens=480)
            assert started.wait(60)
            burst = [pool.submit(client.post, url + "/v1/completions", json={"prompt": f"{i}", "max_tokens": 4})
                     for i in range(5)]
            answers = [f.result() for f in burst]
            assert sorted(r.status_code for r in answers) == [200, 200, 503, 503, 503]
            for r in answers:
                if r.status_code == 503:
                    assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "server_overloaded"
                else:
                    assert r.json()["usage"]["completion_tokens"] == 4
            assert finish_reason(running.result()) == "length"

            done.clear()
            started = threading.Event()
            low = pool.submit(stream, "priority 5", started, max_tokens=480, priority=5)
            assert started.wait(60)
            lowest = pool.submit(stream, "priority 9", max_tokens=4, priority=9)
            deadline = time.time() + 30
            while client.get(url + "/load").json()["queued_requests"] < 1 and time.time() < deadline:
                time.sleep(0.01)
            high = pool.submit(stream, "priority 1", max_tokens=4, priority=1)
            for f in (low, lowest, high):
                assert finish_reason(f.result()) == "length"
            assert done == ["priority 1", "priority 5", "priority 9"], done
            assert "jaxserve:num_preemptions_total 1.0" in client.get(url + "/metrics").text

            done.clear()
            started = threading.Event()
            streams = [pool.submit(stream, f"drained {i}", started, max_tokens=200) for i in range(2)]
            assert started.wait(60)
            while client.get(url + "/load").json()["server_load"] < 2:  # (both in the engine)
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            deadline = time.time() + 10
            while client.get(url + "/health").status_code != 503 and time.time() < deadline:
                time.sleep(0.01)
            assert client.get(url + "/health").status_code == 503
            r = client.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            for f in streams:
                chunks = f.result()
                assert finish_reason(chunks) == "length" and sum(len(c["choices"][0]["text"]) > 0 for c in chunks)
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            assert sorted(done) == ["drained 0", "drained 1"] and "draining" in out


def test_a_short_shutdown_timeout_aborts_the_streams_left():
    port = free_port()
    with serving(port, "--max-model-len", "2048", "--max-num-seqs", "1", "--shutdown-timeout", "0.5") as proc:
        url, lines = f"http://127.0.0.1:{port}", [[], []]

        def stream(i: int) -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as s:
                lines[i] += [line[len("data: "):] for line in s.iter_lines() if line.startswith("data: ")]

        readers = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for reader in readers:
            reader.start()
        while not all(f"jaxserve:num_requests_{gauge} 1.0" in httpx.get(url + "/metrics").text
                      for gauge in ("running", "waiting")):  # (one streams, the other waits for the seat)
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        for reader, events in zip(readers, lines):
            reader.join(10)
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert "aborting the requests still in flight" in out


def test_a_second_signal_exits_at_once():
    port = free_port()
    with serving(port, "--max-model-len", "512", "--max-num-seqs", "1", "--shutdown-timeout", "300") as proc:
        url = f"http://127.0.0.1:{port}"

        def request():
            with contextlib.suppress(httpx.HTTPError):  # (the server goes away mid-answer)
                httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "x", "max_tokens": 500,
                                                                       "ignore_eos": True})

        reader = threading.Thread(target=request, daemon=True)
        reader.start()
        while httpx.get(url + "/metrics").text.find("jaxserve:num_requests_running 1.0") < 0:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while httpx.get(url + "/health").status_code != 503:
            time.sleep(0.01)
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM and time.time() - start < 5, out
        assert "exiting now" in out


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for part in m['content'] %}{{ part['text'] }}|"
                  "{% endfor %}{% endfor %}<assistant>")


def test_every_server_flag_through_main_does_what_it_says(tmp_path):
    """One server through `run_server.main()` with the server-level flags the other tests leave at their
    defaults, each checked by what it does (the engine's flags are EngineConfig's, tested as such)."""
    port, template = free_port(), tmp_path / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    flags = ["--host", "127.0.0.1", "--max-model-len", "512", "--max-num-seqs", "1", "--max-num-batched-tokens", "32",
             "--uvicorn-log-level", "warning", "--enable-log-requests", "--disable-log-stats",
             "--allowed-origins", '["http://ok.example"]', "--allowed-methods", '["POST"]',
             "--allowed-headers", '["Content-Type"]', "--allow-credentials", "--max-request-body-bytes", "4096",
             "--max-num-queued-tokens", "1", "--served-model-name", "first", "second",
             "--chat-template", str(template), "--chat-template-content-format", "openai",
             "--trust-request-chat-template", "--chat-template-timeout", "0.5", "--tool-call-parser", "hermes",
             "--no-enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1", "--return-tokens-as-token-ids",
             "--response-role", "bot", "--enable-force-include-usage", "--disable-fastapi-docs",
             "--disable-playground", "--enable-prompt-tokens-details", "--enable-server-load-tracking",
             "--disable-uvicorn-access-log", "--disable-frontend-multiprocessing"]
    with serving(port, *flags) as proc:
        url, chat = f"http://127.0.0.1:{port}", [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]

        def post(path: str, **body) -> httpx.Response:
            return httpx.post(url + path, json={"max_tokens": 3, **body}, timeout=60)

        # the served names: the one asked for is answered; the template reads the content's parts
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["first", "second"]
        r = post("/v1/chat/completions", model="second", messages=chat, temperature=0)
        answer = r.json()
        assert r.status_code == 200 and answer["model"] == "second", r.text
        message = answer["choices"][0]["message"]
        assert message["role"] == "bot"  # --response-role
        assert message["reasoning"] and not message["content"]  # deepseek_r1: all thinking until </think>
        assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # Anthropic's SDK: the same thinking as a thinking block, under the name asked for
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        reply = claude.messages.create(model="second", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                       thinking={"type": "enabled", "budget_tokens": 2})
        assert [block.type for block in reply.content] == ["thinking"] and reply.content[0].thinking
        assert reply.model == "second" and reply.stop_reason == "max_tokens"
        tokens = httpx.post(url + "/tokenize", json={"messages": chat}).json()["tokens"]
        assert bytes(tokens).decode() == "<user>hi|<assistant>"
        # a request's own template, trusted, and bounded in time
        own = post("/v1/chat/completions", messages=chat, chat_template="{{ messages[0]['role'] }}!")
        assert own.status_code == 200, own.text
        slow = post("/v1/chat/completions", messages=chat,  # (10^10 turns: the sandbox caps each range at 10^5)
                    chat_template="{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}")
        assert slow.status_code == 400 and "0.5 s" in slow.json()["error"]["message"], slow.text
        # tool_choice "auto" refused, logprobs as token ids, a stream's usage unasked
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert post("/v1/chat/completions", messages=chat, tools=tools, tool_choice="auto").status_code == 400
        logprobs = post("/v1/completions", prompt="hi", logprobs=1).json()["choices"][0]["logprobs"]
        assert all(token.startswith("token_id:") for token in logprobs["tokens"])
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                          timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens"] == 2
        # CORS: the allowed origin, method and header only, with credentials
        preflight = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "content-type"}
        ok = httpx.options(url + "/v1/completions", headers=preflight)
        assert ok.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        assert ok.headers["Access-Control-Allow-Credentials"] == "true"
        for wrong in ({"Origin": "http://other.example"}, {"Access-Control-Request-Method": "DELETE"}):
            refused = httpx.options(url + "/v1/completions", headers={**preflight, **wrong})
            assert "Access-Control-Allow-Origin" not in refused.headers or refused.status_code >= 400, wrong
        # the body limit; no docs, no playground; the load endpoint
        big = httpx.post(url + "/v1/completions", content=b'{"prompt": "' + b"a" * 5000 + b'"}',
                         headers={"Content-Type": "application/json"})
        assert big.status_code == 413
        assert httpx.get(url + "/openapi.json").status_code == 404 and httpx.get(url + "/").status_code == 404
        # one seat, and at most one waiting prompt token (one request alone always waits): a third is a 503
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(post, "/v1/completions", prompt="a", max_tokens=480, ignore_eos=True)
            waiting = None
            while not long.done():
                load = httpx.get(url + "/load").json()
                if load["server_load"] >= 1 and waiting is None:
                    waiting = pool.submit(post, "/v1/completions", prompt="bb", max_tokens=1)
                elif waiting is not None and load["queued_requests"] >= 1:
                    third = post("/v1/completions", prompt="cc", max_tokens=1)
                    assert third.status_code == 503 and "--max-num-queued-tokens" in third.text, third.text
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the long request ended before the queue filled")
            assert long.result().status_code == 200 and waiting.result().status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "Running on" not in out  # --uvicorn-log-level warning
    assert "Avg prompt throughput" not in out  # --disable-log-stats
    assert out.count("prompt tokens") >= 5  # --enable-log-requests
