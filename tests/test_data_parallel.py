"""Data-parallel replicas behind one API (`--data-parallel-size`), the router that places requests
by load and prefix, and the KV events external routers read (`--kv-events-config`).

One `python run_server.py --data-parallel-size 2` on two virtual CPU devices serves the module: its
answers and prefix-cache hit rate are compared with the shared one-replica server's on the same
requests, and a ZMQ subscriber checks its KV events against the prompts' own page keys.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import msgpack
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from server import ROOT, free_port, serving
from test_api_metrics import scrape

from jaxserve.config.kv_events import KVEventsConfig
from jaxserve.engine.admission import QueueBound
from jaxserve.engine.kv_events import END_OF_REPLAY, KVEventPublisher, block_hash
from jaxserve.engine.outputs import Update
from jaxserve.engine.ray_replicas import default_bundle, placement
from jaxserve.engine.replicas import Replicas, Router
from jaxserve.errors import QueueFull, ReplicaLost
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.pages import prefix_hashes
from jaxserve.structured_output.grammar import Constraint, GrammarMatchers, mask_width

PAGE = 16  # the servers' page size (the default)
SYSTEMS = [[100 + 8 * s + i % 7 for i in range(3 * PAGE)] for s in range(8)]  # 8 "system prompts" of 3 pages
# 200 prompts: a system prompt and 5 tokens of their own (no other full page: with 2 tokens generated,
# the pages stored are the system prompts' only)
PROMPTS = [SYSTEMS[i % 8] + [20 + i % 50, 21, 22, 23, 24 + i // 50] for i in range(200)]
FLAGS = ("--max-model-len", "320", "--max-num-seqs", "16", "--max-num-batched-tokens", "64", "--num-pages", "64")


class Subscriber:
    """A router's view of the KV events: a thread that receives every batch of every replica."""

    def __init__(self, endpoints: list[str]):
        self.batches: list[tuple[int, list]] = []  # (sequence number, [ts, events, rank])
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"kv")
        for endpoint in endpoints:
            self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._socket.poll(50):
                topic, number, payload = self._socket.recv_multipart()
                assert topic == b"kv"
                self.batches.append((int.from_bytes(number, "big"), msgpack.unpackb(payload)))

    def events(self, kind: str) -> list[tuple[int, dict]]:
        return [(rank, e) for _, (_, events, rank) in self.batches for e in events if e["type"] == kind]

    def close(self):
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """(base URL, KV events subscriber) of a server of two replicas, one virtual device each."""
    events = tmp_path_factory.mktemp("events") / "kv"
    subscriber = Subscriber([f"ipc://{events}", f"ipc://{events}_dp1"])
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"ipc://{events}", "topic": "kv"})
    port = free_port()
    with serving(port, "--data-parallel-size", "2", "--kv-events-config", config, *FLAGS,
                 env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}):
        url = f"http://127.0.0.1:{port}"
        _wait_until_compiled(url)
        yield url, subscriber
    subscriber.close()


def _wait_until_compiled(url: str) -> None:
    """Until both replicas have compiled every step bucket: /health answers once one replica serves, and
    the prompts' prefixes would all be placed on it (their replica keeps them while it has seats)."""
    deadline = time.time() + 240
    while True:
        figures = {f.name: f.samples[0].value for f in text_string_to_metric_families(
            httpx.get(url + "/metrics", timeout=60).text) if f.name.startswith("jaxserve:step_buckets")}
        if figures["jaxserve:step_buckets_compiled"] == figures["jaxserve:step_buckets"]:
            return
        assert time.time() < deadline, "the replicas did not compile their step buckets"
        time.sleep(0.5)


def _complete_all(url: str, prompts: list[list[int]]) -> list[str]:
    """Greedy completions of 2 tokens, 16 requests at a time."""
    def one(prompt):
        r = httpx.post(url + "/v1/completions", json={"model": "jaxserve-tiny", "prompt": prompt, "max_tokens": 2,
                                                     "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, prompts))


def _hit_rate(before: dict, after: dict, keys: list[str]) -> float:
    hits = sum(after.get(f"{k}prefix_cache_hits_total{s}", 0) - before.get(f"{k}prefix_cache_hits_total{s}", 0)
               for k, s in keys)
    queries = sum(after.get(f"{k}prefix_cache_queries_total{s}", 0) -
                  before.get(f"{k}prefix_cache_queries_total{s}", 0) for k, s in keys)
    return hits / queries


def test_two_replicas_share_the_load_keep_prefix_affinity_and_answer_as_one(replicas, served):
    url, _ = replicas
    texts = _complete_all(url, PROMPTS)
    metrics = scrape((type("S", (), {"url": url}),))
    per_engine = [f"|{e}|jaxserve-tiny" for e in ("0", "1")]
    assert all(metrics[f"vllm:generation_tokens_total{e}"] > 0 for e in per_engine)  # both replicas were used
    assert metrics["jaxserve:generation_tokens_total"] == sum(metrics[f"vllm:generation_tokens_total{e}"]
                                                              for e in per_engine) == 2 * len(PROMPTS)
    dp_rate = _hit_rate({}, metrics, [("vllm:", e) for e in per_engine])
    before = scrape(served)
    assert _complete_all(served[0].url, PROMPTS) == texts  # greedy: what one replica answers
    one_rate = _hit_rate(before, scrape(served), [("jaxserve:", "")])
    assert one_rate > 0.5 and abs(dp_rate - one_rate) <= 0.1, (dp_rate, one_rate)


def test_kv_events_name_the_pages_the_prompts_store_and_what_pressure_evicts(replicas):
    url, subscriber = replicas
    _complete_all(url, PROMPTS)  # (the module's first test may not have run)
    expected = {block_hash(key) for prompt in PROMPTS for key in prefix_hashes(prompt, PAGE)}
    stored = subscriber.events("BlockStored")
    assert {h for _, e in stored for h in e["block_hashes"]} == expected
    assert {rank for rank, _ in stored} == {0, 1}
    for _, e in stored:  # each run of pages chains from the page before it, with its tokens
        assert e["block_size"] == PAGE and len(e["token_ids"]) == PAGE * len(e["block_hashes"])
        system, keys = next((s, keys) for s in SYSTEMS
                            if e["block_hashes"][0] in (keys := [block_hash(k) for k in prefix_hashes(s, PAGE)]))
        first = keys.index(e["block_hashes"][0])
        assert e["block_hashes"] == keys[first:first + len(e["block_hashes"])]
        assert e["parent_block_hash"] == (keys[first - 1] if first else None)
        assert e["token_ids"] == system[first * PAGE:(first + len(e["block_hashes"])) * PAGE]
    # memory pressure: long prompts of their own need the pages the system prompts keep cached
    long_prompts = [[200 + i] + [(7 * i + j) % 97 + 3 for j in range(249)] for i in range(8)]
    _complete_all(url, long_prompts)
    for _ in range(100):  # (the last batches may still be on their way)
        removed = {h for _, e in subscriber.events("BlockRemoved") for h in e["block_hashes"]}
        if removed & expected:
            break
        threading.Event().wait(0.1)
    stored_now = {h for _, e in subscriber.events("BlockStored") for h in e["block_hashes"]}
    assert removed & expected and removed <= stored_now
    numbers = {}
    for number, (_, _, rank) in subscriber.batches:  # each replica numbers its batches one after another
        numbers.setdefault(rank, []).append(number)  # (from 0, its start's AllBlocksCleared, which a
    assert all(n == list(range(n[0], n[0] + len(n))) for n in numbers.values())  # late subscriber misses)


def test_the_router_follows_the_prefix_until_its_replica_is_a_batch_ahead_or_full():
    router = Router(replicas=3, page_size=4, slack=8)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert [router.choose([i], None, [0, 0, 0]) for i in range(4)] == [0, 1, 2, 0]  # no prefix: in turn
    first = router.choose(a, None, [5, 0, 5])
    assert first == 1
    assert router.choose(a + [10], None, [0, 8, 0]) == 1  # its prefix's replica, 8 ahead: still chosen
    assert router.choose(a + [11], None, [0, 9, 0]) == 2  # 9 ahead: the least loaded (ties in turn) instead
    assert router.choose(a, None, [0, 0, 1]) == 2  # ... which now holds the prefix
    assert router.choose(a, "tenant", [3, 3, 0]) == 2  # another salt: another prefix
    assert router.choose(a[:8] + list(range(20, 40)), None, [0, 1, 0]) == 0  # a prefix under half: by load
    assert router.choose(b, None, [0, 0, 0]) in (0, 1, 2)
    assert Router(replicas=1, page_size=4, slack=0).choose(a, None, [100]) == 0
    seated = Router(replicas=2, page_size=4, slack=8, seats=4)
    assert seated.choose(a, None, [0, 0]) == 0
    assert seated.choose(a, None, [3, 0]) == 0  # a seat free on the prefix's replica: there
    assert seated.choose(a, None, [4, 0]) == 1  # none (it would wait), one free on the other: there
    assert seated.choose(a, None, [8, 5]) == 1  # ... (now the prefix's replica)
    assert seated.choose(a, None, [4, 5]) == 1  # both full: the prefix's, within the slack


def test_replicas_stop_together():
    """Every replica is told to stop at once: one after another, each would go on compiling until its
    turn. (Here each stop waits for the other's: called in turn, the barrier would time out.)"""
    together = threading.Barrier(2, timeout=10)

    class Stopping:
        engine = SimpleNamespace(config=SimpleNamespace(page_size=PAGE, max_num_seqs=4))

        def shutdown(self, timeout):
            together.wait()
            return True

    assert Replicas([Stopping(), Stopping()]).shutdown()


def test_kv_events_config_is_vllms():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse({"enable_kv_cache_events": False}) is None
    assert KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}) is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "t"}')
    assert config.endpoint == "tcp://*:5557" and config.topic == "t"
    assert config.endpoint_of("tcp://*:5557", 3) == "tcp://*:5560"
    assert config.endpoint_of("inproc://cache", 1) == "inproc://cache_dp1"
    for bad, says in (({"enable_kv_cache_events": True, "colour": 1}, "'colour' not supported"),
                      ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be"),
                      ({"enable_kv_cache_events": True, "hwm": 0}, "hwm must be"),
                      ({"enable_kv_cache_events": True, "endpoint": "http://x"}, "endpoint must be")):
        with pytest.raises(ValueError, match=says):
            KVEventsConfig.parse(bad)


def test_offline_llm_runs_its_replicas_side_by_side_and_answers_as_one():
    """`LLM(data_parallel_size=2)` on two virtual devices (a process of its own): the same greedy
    outputs as one replica, each replica having run some of the prompts."""
    script = """
from jaxserve import LLM, SamplingParams
settings = dict(model="jaxserve-tiny", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, num_pages=24)
prompts = [[7 + i % 3] * 20 + [i] for i in range(12)]
greedy = SamplingParams(max_tokens=6, temperature=0)
two = LLM(data_parallel_size=2, **settings)
outputs = [o.outputs[0].token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
assert all(e.stats.num_generated_tokens for e in two.engines), [e.stats for e in two.engines]
one = LLM(**settings)
assert outputs == [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
assert two.reset_prefix_cache()
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


class _Replica:
    """A replica for the balancer alone: answers one update, or goes away before (`lose`) or after it."""

    def __init__(self, lose: str | None = None):
        self.engine = SimpleNamespace(config=SimpleNamespace(page_size=PAGE, max_num_seqs=4))
        self.lose, self.served, self.is_ready, self.hold = lose, [], True, None  # hold: an event each waits for
        self.admission = SimpleNamespace(queued=(0, 0))
        self.stats = SimpleNamespace(num_running=0)

    async def generate(self, request_id, prompt, params, **options):
        if self.lose == "before":
            raise ReplicaLost("gone")
        self.served.append(request_id)
        if hasattr(self.admission, "arrived"):  # (in the engine's queue: its figures count it from its next step)
            self.admission.arrived(request_id)
        if self.hold is not None:
            await self.hold.wait()
        yield Update(request_id=request_id, index=0, text="x", token_ids=[1], num_prompt_tokens=len(prompt),
                     logprobs=[], num_cached_tokens=0, num_output_tokens=1, finish_reason=None, stop_reason=None)
        if self.lose == "after":
            raise ReplicaLost("gone")


def _updates(front: Replicas, request_id: str) -> list:
    async def run():
        return [u async for u in front.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=1))]
    return asyncio.run(run())


def test_a_request_whose_replica_goes_away_before_answering_runs_on_another():
    lost, alive = _Replica(lose="before"), _Replica()
    front = Replicas([lost, alive])
    for i in range(4):  # (whichever replica each is routed to first)
        assert len(_updates(front, f"r{i}")) == 1
    assert alive.served == ["r0", "r1", "r2", "r3"]
    alive.lose = "after"  # once part of the answer went out, the loss is the request's error
    with pytest.raises(ReplicaLost):
        _updates(front, "r4")
    alive.lose = lost.lose = "before"
    with pytest.raises(ReplicaLost):  # none left to try
        _updates(front, "r5")
    alive.lose, lost.lose, lost.is_ready = None, None, False  # a replica that is not ready gets no request
    for i in range(3):
        _updates(front, f"s{i}")
    assert alive.served[-3:] == ["s0", "s1", "s2"] and not lost.served


def test_a_ray_replica_spans_its_hosts_on_separate_nodes_with_the_clusters_accelerators():
    assert placement({"CPU": 1, "TPU": 4}, 1) == ([{"CPU": 1, "TPU": 4}], "PACK")
    assert placement({"TPU": 4}, 4) == ([{"TPU": 4}] * 4, "STRICT_SPREAD")
    with pytest.raises(ValueError):
        placement({"CPU": 1}, 0)
    assert default_bundle({"CPU": 8, "GPU": 8}, tensor_parallel_size=2, hosts=1) == {"CPU": 1, "GPU": 2}
    assert default_bundle({"CPU": 8, "TPU": 16}, tensor_parallel_size=16, hosts=4) == {"CPU": 1, "TPU": 4}
    assert default_bundle({"CPU": 8}, tensor_parallel_size=1, hosts=1) == {"CPU": 1}


def test_kv_events_replay_resends_the_kept_batches_from_a_sequence_number(tmp_path):
    config = KVEventsConfig.parse({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pub",
                                   "replay_endpoint": f"ipc://{tmp_path}/replay", "buffer_steps": 2})
    publisher = KVEventPublisher(config, replica=0, page_size=PAGE)
    try:
        for i in range(3):
            publisher.publish([("removed", [bytes([i]) * 32])])
        publisher.publish([])  # (nothing: no batch)
        client = zmq.Context.instance().socket(zmq.DEALER)  # (a REQ socket would take one reply only)
        client.connect(config.replay_endpoint)
        got, deadline = [], time.monotonic() + 10
        while (not got or got[-1][0] != 3) and time.monotonic() < deadline:  # (until all 4 are sent)
            client.send_multipart([b"", (0).to_bytes(8, "big")])
            got = []
            while client.poll(5000):
                _, number, payload = client.recv_multipart()
                if number == END_OF_REPLAY:
                    break
                got.append((int.from_bytes(number, "big"), msgpack.unpackb(payload)))
        client.close(linger=0)
        assert [n for n, _ in got] == [2, 3]  # the last buffer_steps batches (0: the start's AllBlocksCleared)
        assert [batch[1][0]["block_hashes"] for _, batch in got] == [[block_hash(bytes([i]) * 32)] for i in (1, 2)]
    finally:
        publisher.close()


def test_the_replicas_of_one_process_compile_each_grammar_once(offline):
    """Each replica keeps its own sequences' matchers, copied from grammars compiled once in the
    process: the API's check compiles a constraint for whichever replica runs it."""
    hf, vocab = offline.tokenizer.hf, offline.engine.model_config.vocab_size
    first, second = GrammarMatchers(hf, vocab), GrammarMatchers(hf, vocab)
    constraint = Constraint("regex", "[a-z]{2,5}")
    assert first.compiled(constraint) is second.compiled(constraint)
    row = np.zeros(mask_width(vocab), np.int32)
    first.fill(1, constraint, row)
    second.fill(1, constraint, row)  # (the same sequence id in two replicas: two matchers)
    assert first.accept(1, hf.encode("ab", add_special_tokens=False)[0]) is None
    assert first._matchers[1] is not second._matchers[1]


def test_the_load_is_what_the_front_sent_and_has_not_seen_finish():
    """A replica's own figures lag its steps (here one still counts three sequences that have since
    finished, the other none, and neither what the front sent since): the front balances by the
    requests it sent each replica, the first `max_num_seqs` (4) of them running and the others
    waiting (vLLM's score, 4 x waiting + running)."""
    stale, fresh = _Replica(), _Replica()
    stale.stats.num_running = 3
    for replica in (stale, fresh):
        replica.admission = QueueBound(None, None, lambda: (0, 0))
    front = Replicas([stale, fresh])
    prompts = [[7 * i + j for j in range(5)] for i in range(10)]  # (no shared pages: no prefix affinity)

    async def run():
        release = asyncio.Event()
        for replica in (stale, fresh):
            replica.hold = release
        tasks = []
        for i, prompt in enumerate(prompts[:8]):
            front.admit([(f"r{i}", prompt)])
            tasks.append(asyncio.create_task(_drain(front.generate(f"r{i}", prompt, SamplingParams(max_tokens=1)))))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert len(stale.served) == len(fresh.served) == 4
        assert [front.load(r) for r in (0, 1)] == [4, 4]
        front.admit([("r8", prompts[8])])  # (a fifth request waits: it weighs 4)
        assert sorted(front.load(r) for r in (0, 1)) == [4, 8]
        release.set()
        await asyncio.gather(*tasks)
        assert front._active == {} and sorted(front.load(r) for r in (0, 1)) == [0, 1]  # (r8 admitted, not sent)

    asyncio.run(run())


async def _drain(updates) -> list:
    return [u async for u in updates]


def test_a_request_for_a_full_replica_goes_to_one_with_room_and_a_refused_one_holds_no_place():
    first, second = _Replica(), _Replica()
    for replica in (first, second):
        replica.admission = QueueBound(1, None, lambda: (0, 0))
    front = Replicas([first, second])
    prompt = list(range(3 * PAGE))
    front.admit([("a", prompt)])
    front.admit([("b", prompt)])  # (the prefix's replica is full: the other one has room)
    assert first.admission.queued[0] == second.admission.queued[0] == 1
    with pytest.raises(QueueFull):
        front.admit([("c", prompt)])
    with pytest.raises(QueueFull):  # two prompts of one request: both or neither
        front.admit([("d", [1, 2]), ("e", [3, 4])])
    assert first.admission.queued[0] == second.admission.queued[0] == 1 and set(front._pending) == {"a", "b"}
    assert [u.request_id for u in _updates(front, "a")] == ["a"]
    assert not front._pending.get("a") and front._active == {}
