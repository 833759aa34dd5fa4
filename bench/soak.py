"""A soak of the server: a few hundred requests of a mixed load, more at once than the batch holds,
then checks that the server answered every one well and came back to idle as it was.

    python bench/soak.py [--requests 400] [--warmup 200] [--concurrency 12] [--max-num-seqs 4]
                         [--max-num-queued-reqs 4] [--max-num-queued-tokens 1024] [--seed 0] [--time-limit 1200]

1. Starts `run_server.py --model jaxserve-tiny` (small settings, a bounded waiting queue, loopback) and
   waits until every step bucket is compiled.
2. Warm-up: `--warmup` requests of the mix; waits for idle; reads the server's resident memory.
3. The run: `--requests` requests of the same mix, `--concurrency` at once: chat and completions,
   streamed or not, n > 1, JSON-schema grammars, tools (required and named), beam search, bad inputs
   (invalid JSON, wrong types, too long prompts, an unknown model), streams whose client hangs up
   after a few chunks, and clients that give up waiting for a whole answer.
4. Checks, and prints the result block for bench/RESULTS.md: every answer well-formed (a 2xx with a
   valid body, streams ending with `data: [DONE]`; or OpenAI's error body with the expected 4xx, or a
   503 with Retry-After where the queue is bounded), no other 5xx, KV pages all free when idle,
   resident memory within 5 % of the warm-up's, the event loop's lag (/metrics) within `--lag-bound`
   while serving. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from common import free_port, machine_line, server

MODEL = "jaxserve-tiny"
MAX_MODEL_LEN = 256
LAG_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0)  # edges of /metrics' event loop lag histogram (api/metrics.py)
RSS_GROWTH = 0.05  # the resident memory after the run may exceed the warm-up's by this fraction
RETRIES, MAX_RETRY_WAIT = 3, 1.0  # after a bounded queue's 503: how often a call is sent again, the longest wait
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran far".split()


@dataclasses.dataclass
class Call:
    """One request of the mix, and what a well-formed answer to it is."""
    kind: str
    path: str
    body: dict | bytes
    expect: int = 200  # the status; a 2xx is checked by `check_body`
    n: int = 1  # choices
    stream: bool = False
    hang_up: int = 0  # a streaming client that closes the connection after this many events
    give_up: float | None = None  # a client that closes the connection after this many seconds without an answer
    check_body: Callable[[dict], str | None] | None = None  # more checks of each choice (None: fine)


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _sampling(rng: random.Random) -> dict:
    return {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(1000), "max_tokens": rng.randint(4, 24)}


def _messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": _text(rng, rng.randint(3, 30))}]


def _json_object(choice: dict) -> str | None:
    if choice["finish_reason"] != "stop":
        return None  # (cut short by max_tokens)
    value = json.loads(choice["message"]["content"])
    ok = isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("age"), int)
    return None if ok else f"not the schema's object: {value!r}"


def _tool_call(choice: dict) -> str | None:
    if choice["finish_reason"] == "length":
        return None
    calls = choice["message"].get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "get_weather":
        return f"no call to get_weather: {choice['message']!r}"
    json.loads(calls[0]["function"]["arguments"])
    return None


def mix(rng: random.Random) -> Call:
    """One request, drawn from the mix."""
    kinds = {
        "chat": 12, "completion": 10, "chat_stream": 10, "completion_stream": 8, "n>1": 6, "json_schema": 6,
        "tools_required": 4, "tools_named": 4, "beam_search": 4, "hang_up": 8, "give_up": 3, "bad_json": 3,
        "wrong_type": 3, "too_long": 3, "unknown_model": 3,
    }
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    chat = {"messages": _messages(rng), **_sampling(rng)}
    completion = {"prompt": _text(rng, rng.randint(3, 30)), **_sampling(rng)}
    usage = {"stream_options": {"include_usage": True}}
    tools = {**chat, "max_tokens": 48, "tools": WEATHER}
    calls = {
        "chat": lambda: Call(kind, "/v1/chat/completions", chat),
        "completion": lambda: Call(kind, "/v1/completions", completion),
        "chat_stream": lambda: Call(kind, "/v1/chat/completions", {**chat, "stream": True, **usage}, stream=True),
        "completion_stream": lambda: Call(kind, "/v1/completions", {**completion, "stream": True}, stream=True),
        "n>1": lambda: Call(kind, "/v1/completions", {**completion, "n": 3, "temperature": 1.0,
                                                      "stream": rng.random() < 0.5}, n=3),
        "json_schema": lambda: Call(kind, "/v1/chat/completions", {**chat, "max_tokens": 48, "response_format": {
            "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}, check_body=_json_object),
        "tools_required": lambda: Call(kind, "/v1/chat/completions", {**tools, "tool_choice": "required"},
                                       check_body=_tool_call),
        "tools_named": lambda: Call(kind, "/v1/chat/completions", {**tools, "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}}, check_body=_tool_call),
        "beam_search": lambda: Call(kind, "/v1/completions", {"prompt": completion["prompt"], "max_tokens": 8, "n": 2,
                                                              "use_beam_search": True, "temperature": 0.0}, n=2),
        "hang_up": lambda: Call(kind, "/v1/completions", {**completion, "max_tokens": 64, "ignore_eos": True,
                                                          "stream": True}, stream=True, hang_up=rng.randint(1, 4)),
        "give_up": lambda: Call(kind, "/v1/chat/completions", {**chat, "max_tokens": 64, "ignore_eos": True},
                                give_up=rng.uniform(0.02, 0.5)),
        "bad_json": lambda: Call(kind, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"', 400),
        "wrong_type": lambda: Call(kind, rng.choice(["/v1/chat/completions", "/v1/completions"]),
                                   {**chat, **completion, rng.choice(["max_tokens", "temperature", "n"]): "ten"}, 400),
        "too_long": lambda: Call(kind, "/v1/completions", {**completion, "prompt": _text(rng, 2 * MAX_MODEL_LEN)}, 400),
        "unknown_model": lambda: Call(kind, "/v1/chat/completions", {**chat, "model": "no-such-model"}, 404),
    }
    call = calls[kind]()
    if isinstance(call.body, dict) and call.body.get("stream"):
        call.stream = True
    return call


# --- what a well-formed answer is

FINISH = ("stop", "length", "tool_calls")


def error_shape(data) -> str | None:
    """None where `data` is OpenAI's error body."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str):
        return None
    return f"not OpenAI's error body: {data!r:.200}"


def _usage(usage) -> str | None:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    if isinstance(usage, dict) and all(isinstance(usage.get(k), int) for k in keys) and \
            usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]:
        return None
    return f"bad usage {usage!r}"


def _choice(call: Call, choice: dict, chat: bool) -> str | None:
    if choice.get("finish_reason") not in FINISH:
        return f"finish_reason {choice.get('finish_reason')!r}"
    if chat and not (choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str | None)):
        return f"bad message {choice['message']!r}"
    if not chat and not isinstance(choice["text"], str):
        return f"bad text {choice['text']!r}"
    return call.check_body(choice) if call.check_body else None


def check_answer(call: Call, data: dict) -> str | None:
    """None where `data` is a whole chat completion or completion with the call's n choices."""
    chat = call.path == "/v1/chat/completions"
    if data.get("object") != ("chat.completion" if chat else "text_completion"):
        return f"object {data.get('object')!r}"
    if sorted(c["index"] for c in data["choices"]) != list(range(call.n)):
        return f"choice indices {[c['index'] for c in data['choices']]}"
    return next(filter(None, (_choice(call, c, chat) for c in data["choices"])), None) or _usage(data.get("usage"))


def check_stream(call: Call, lines: list[str]) -> str | None:
    """None where the events are chunks of the call's n choices, each finished once, then `data: [DONE]`."""
    chat = call.path == "/v1/chat/completions"
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"the stream does not end with data: [DONE] (last lines {lines[-2:]!r})"
    finished, usage = collections.Counter(), None
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return f"an error in the stream: {chunk!r:.200}"
        if chunk.get("object") != ("chat.completion.chunk" if chat else "text_completion"):
            return f"chunk object {chunk.get('object')!r}"
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            if choice["index"] not in range(call.n):
                return f"choice index {choice['index']}"
            part = choice["delta"].get("content") if chat else choice["text"]
            if not isinstance(part, str | None):
                return f"bad delta {choice!r}"
            finished[choice["index"]] += choice.get("finish_reason") is not None
            if choice.get("finish_reason") not in (None, *FINISH):
                return f"finish_reason {choice.get('finish_reason')!r}"
    if finished != collections.Counter(range(call.n)):
        return f"finish reasons per choice {dict(finished)}"
    return _usage(usage) if call.body.get("stream_options", {}).get("include_usage") else None


def judge(call: Call, status: int, headers: httpx.Headers, raw: bytes, queue_limited: bool) -> str | None:
    """None where the answer is well-formed and the status the expected one (or a 503 when the queue is
    bounded); else what is wrong."""
    try:
        if status == 503 and queue_limited:
            return error_shape(json.loads(raw)) or (None if "retry-after" in headers else "a 503 without Retry-After")
        if status != call.expect:
            return f"HTTP {status}, expected {call.expect}: {raw[:200]!r}"
        if status >= 400:
            return error_shape(json.loads(raw))
        if call.stream:
            return check_stream(call, raw.decode().splitlines())
        return check_answer(call, json.loads(raw))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"malformed answer ({type(e).__name__}: {e}): {raw[:200]!r}"


# --- the load

@dataclasses.dataclass
class Tally:
    # (kind, HTTP status or "no answer" or "gave up") -> count
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    problems: list[str] = dataclasses.field(default_factory=list)
    hung_up: int = 0  # answers the client closed the connection on (mid-stream, or before any came)
    retried: int = 0  # calls sent again after a 503

    def server_errors(self, queue_limited: bool) -> int:
        """Answers with a 5xx (but a bounded queue's 503), or none."""
        def failed(status: int | str) -> bool:
            if isinstance(status, str):
                return status == "no answer"  # (not "gave up")
            return status >= 500 and not (status == 503 and queue_limited)

        return sum(n for (_, status), n in self.statuses.items() if failed(status))


async def send(client: httpx.AsyncClient, url: str, call: Call, tally: Tally, queue_limited: bool) -> None:
    """The call, sent again after a bounded queue's 503 (as the OpenAI SDK does) up to RETRIES times."""
    for retry in range(RETRIES + 1):
        if (wait := await attempt(client, url, call, tally, queue_limited)) is None or retry == RETRIES:
            return
        tally.retried += 1
        await asyncio.sleep(wait)


async def attempt(client: httpx.AsyncClient, url: str, call: Call, tally: Tally, queue_limited: bool) -> float | None:
    """The call sent once, its answer judged and counted; the seconds to wait before sending it again
    where a bounded queue said so (a 503 with Retry-After), else None."""
    content = dict(content=call.body) if isinstance(call.body, bytes) else dict(json=call.body)
    if call.give_up is not None:
        content["timeout"] = call.give_up
    try:
        async with client.stream("POST", url + call.path, headers={"Content-Type": "application/json"},
                                 **content) as r:
            if call.hang_up and r.status_code == 200:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: ")
                    if events >= call.hang_up:
                        tally.hung_up += 1
                        break  # (leaving the block closes the connection mid-stream)
                tally.statuses[call.kind, r.status_code] += 1
                return None
            raw = await r.aread()
    except httpx.TimeoutException as e:
        if call.give_up is not None:
            tally.statuses[call.kind, "gave up"] += 1
            tally.hung_up += 1
            return None
        tally.statuses[call.kind, "no answer"] += 1
        tally.problems.append(f"{call.kind}: {type(e).__name__}: {e}")
        return None
    except httpx.HTTPError as e:
        tally.statuses[call.kind, "no answer"] += 1
        tally.problems.append(f"{call.kind}: {type(e).__name__}: {e}")
        return None
    tally.statuses[call.kind, r.status_code] += 1
    if problem := judge(call, r.status_code, r.headers, raw, queue_limited):
        tally.problems.append(f"{call.kind}: {problem}")
        return None
    if r.status_code == 503 and queue_limited:
        return min(float(r.headers["retry-after"]), MAX_RETRY_WAIT) * random.uniform(0.5, 1.0)
    return None


async def phase(url: str, calls: list[Call], concurrency: int, queue_limited: bool) -> Tally:
    """The calls, `concurrency` at a time."""
    tally = Tally()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def one(call: Call):
            async with gate:
                await send(client, url, call, tally, queue_limited)

        await asyncio.gather(*(one(call) for call in calls))
    return tally


# --- the server's state

def scrape(url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {key: float(value) for key, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    """/metrics once no sequence runs, waits or holds a KV page (or after `timeout` seconds)."""
    deadline = time.perf_counter() + timeout
    while True:
        values = scrape(url)
        busy = [values[f"jaxserve:{name}"] for name in ("num_requests_running", "num_requests_waiting",
                                                         "kv_pages_used")]
        if not any(busy) or time.perf_counter() > deadline:
            return values
        time.sleep(0.5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def server_pid(port: int) -> int:
    for status in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = status.read_bytes().split(b"\0")
        except OSError:
            continue
        if words[1:2] == [b"run_server.py"] and str(port).encode() in words:  # (python run_server.py ...)
            return int(status.parent.name)
    raise RuntimeError(f"no run_server.py process on port {port}")


# --- the soak

def server_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "run_server.py", "--model", MODEL, "--port", str(port), "--max-num-seqs",
           str(args.max_num_seqs), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "128",
           "--log-level", "warning"]
    for flag in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if getattr(args, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return cmd


def statuses_line(tally: Tally) -> str:
    by_status = collections.Counter()
    for (_, status), n in tally.statuses.items():
        by_status[status] += n
    return ", ".join(f"{status} x {n}" for status, n in sorted(by_status.items(), key=lambda item: str(item[0])))


def lag_line(started: dict[str, float], after: dict[str, float], bound: float) -> tuple[str, bool]:
    """The event loop's lag while serving (warm-up and run), from the histogram's counts since the end of
    start-up: compiling step buckets with a cold cache holds the GIL (the start-up's longest is reported
    apart)."""
    def late(le: str) -> float:
        key = f'jaxserve:event_loop_lag_seconds_bucket{{le="{le}"}}'
        return after[key] - started[key]

    edges = [key.split('"')[1] for key in after if key.startswith("jaxserve:event_loop_lag_seconds_bucket")]
    within = next(le for le in edges if late(le) == late("+Inf"))
    over = late("+Inf") - late(str(bound))
    longest = [values["jaxserve:event_loop_lag_max_seconds"] for values in (started, after)]
    return (f"event loop lag while serving: {late('+Inf'):.0f} wake-ups from 50 ms sleeps, all within {within} s, "
            f"{over:.0f} over the bound of {bound} s; the longest since the server started "
            f"{1e3 * longest[1]:.0f} ms ({1e3 * longest[0]:.0f} ms by the end of start-up)"), over == 0


def soak(args: argparse.Namespace, url: str, pid: int) -> list[tuple[str, bool]]:
    """Warm-up, run, idle; the result lines and whether each check holds."""
    rng = random.Random(args.seed)
    queue_limited = bool(args.max_num_queued_reqs or args.max_num_queued_tokens)
    deadline = time.perf_counter() + args.time_limit

    def run(calls: list[Call]) -> tuple[Tally, float]:
        start = time.perf_counter()
        tally = asyncio.run(asyncio.wait_for(phase(url, calls, args.concurrency, queue_limited),
                                             max(deadline - start, 1)))
        return tally, time.perf_counter() - start

    started = scrape(url)
    warm, _ = run([mix(rng) for _ in range(args.warmup)])
    wait_idle(url, 60)
    rss_before = rss_mib(pid)
    calls = [mix(rng) for _ in range(args.requests)]
    tally, elapsed = run(calls)
    after = wait_idle(url, 60)
    rss_after = rss_mib(pid)
    lag = lag_line(started, after, args.lag_bound)
    kinds = collections.Counter(call.kind for call in calls)
    growth = rss_after / rss_before - 1
    five = tally.server_errors(queue_limited) + warm.server_errors(queue_limited)
    malformed = len(tally.problems) + len(warm.problems) - five
    return [
        (f"requests: {args.requests} after a warm-up of {args.warmup}, {args.concurrency} at once, in "
         f"{elapsed:.0f} s; " + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())), True),
        (f"answers: {statuses_line(tally)}; {tally.retried} sent again after a 503, {tally.hung_up} hung up on "
         "by the client", True),
        (f"5xx or no answer: {five}", five == 0),
        (f"malformed or unexpected answers: {malformed}" + "".join(
            f"\n  {p}" for p in (warm.problems + tally.problems)[:10]), malformed == 0),
        (f"idle after the run: kv_pages_used {after['jaxserve:kv_pages_used']:.0f}, running "
         f"{after['jaxserve:num_requests_running']:.0f}, waiting {after['jaxserve:num_requests_waiting']:.0f}",
         not any(after[f"jaxserve:{name}"] for name in ("kv_pages_used", "num_requests_running",
                                                          "num_requests_waiting"))),
        (f"resident memory: {rss_before:.1f} MiB after the warm-up, {rss_after:.1f} MiB after the run "
         f"({100 * growth:+.1f} %, bound +{100 * RSS_GROWTH:.0f} %)", growth <= RSS_GROWTH),
        lag,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=200, help="requests of the same mix before memory is measured")
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-num-queued-reqs", type=int, default=4,
                    help="the server's flag of that name (0: no bound); 503s with Retry-After count as well-formed "
                         "where the queue is bounded")
    ap.add_argument("--max-num-queued-tokens", type=int, default=1024,
                    help="the server's flag of that name (0: no bound)")
    ap.add_argument("--lag-bound", type=float, default=0.1, choices=LAG_BOUNDS,
                    help="seconds the event loop may be late at most while serving (a bucket of its histogram)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=1200, help="seconds for the warm-up and the run together")
    args = ap.parse_args()
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="jaxserve-soak-", suffix=".log")[1])
    command = " ".join(["python bench/soak.py", *sys.argv[1:]])
    with server(server_command(args, port), port, log=log, timeout=600) as (url, _):
        try:
            results = soak(args, url, server_pid(port))
        except TimeoutError:
            results = [(f"did not finish in --time-limit {args.time_limit:.0f} s", False)]
    errors = sum(" ERROR " in line for line in log.read_text().splitlines())
    results.append((f"server log: {errors} error lines ({log})", errors == 0))
    print(f"`{command}`; {machine_line()}; server: {' '.join(server_command(args, port)[1:])}")
    for line, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {line}")
    sys.exit(0 if all(ok for _, ok in results) else 1)


if __name__ == "__main__":
    main()
