"""Data-parallel replicas as Ray actors (`--data-parallel-backend ray`): placed by placement groups,
restarted by Ray when they die, driven from the API's process through `RayReplica` handles that
`Replicas` balances like the threads of one process.

Each replica is a placement group of one bundle per host it spans (`placement`): one host, or a
multi-host TPU slice, whose actors (one per host, on separate nodes) join one `jax.distributed`
job before JAX starts; the actor on the first host runs the engine and the others follow its steps,
as `run_server.py` runs a multi-host mesh. Ray restarts an actor that dies (`max_restarts=-1`):
requests it was running end with `ReplicaLost` (`Replicas` sends those that had no output yet to
another replica), and the handle's poller marks it unready until its restarted engine is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator

from jaxserve.config.lora import LoRARequest
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.admission import QueueBound
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxserve.engine.build import EngineSpec, build_engines
from jaxserve.engine.outputs import Update
from jaxserve.engine.replicas import total_stats
from jaxserve.errors import ReplicaLost
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.plan import SchedulerStats
from jaxserve.structured_output.grammar import Constraint, compiled_grammars
from jaxserve.worker.sharding import initialize_distributed

log = logging.getLogger(__name__)

NAMESPACE = "jaxserve"
POLL_SECONDS = 0.2  # how often a handle reads its replica's figures
IDLE = SchedulerStats(0, 0, 0, 1, 0, 0, 0, 0, 0, {})  # a replica's figures before it answers
MAX_CALLS = 100_000  # an actor's concurrent calls
PLACEMENT_SECONDS = 300  # how long a replica's placement group may wait for room
COUNTERS = ("num_prompt_tokens", "num_prompt_tokens_computed", "num_generated_tokens", "num_preemptions",
            "num_prefix_queried_tokens", "num_prefix_hit_tokens", "finish_counts", "num_drafts", "num_draft_tokens",
            "num_accepted_tokens", "accepted_per_position", "step_token_counts", "num_step_tokens")


def with_counters(stats: SchedulerStats, before: SchedulerStats) -> SchedulerStats:
    """`stats` with the counters of `before` (a replica's, before it restarted) added: a counter never goes down."""
    total = total_stats([stats, before])
    return dataclasses.replace(stats, **{name: getattr(total, name) for name in COUNTERS})


def placement(bundle: dict, hosts: int) -> tuple[list[dict], str]:
    """The bundles and strategy of one replica's placement group: a bundle per host it spans, each
    on a node of its own (STRICT_SPREAD) where it spans several."""
    if hosts < 1:
        raise ValueError(f"a replica spans at least one host, got {hosts}")
    return [dict(bundle) for _ in range(hosts)], "STRICT_SPREAD" if hosts > 1 else "PACK"


def default_bundle(cluster: dict, tensor_parallel_size: int, hosts: int) -> dict:
    """One host's part of a replica, from what the cluster has: its accelerators (each host's
    share of the tensor-parallel devices) and a CPU."""
    for accelerator in ("TPU", "GPU"):
        if cluster.get(accelerator):
            return {"CPU": 1, accelerator: max(1, tensor_parallel_size // hosts)}
    return {"CPU": 1}


class ReplicaActor:
    """One host's process of a replica (a Ray actor): on the first host the engine, served to the
    API's `RayReplica`; on the others, the follower of its steps."""

    def __init__(self, config: EngineConfig, chat_template: str | None, rank: int, coordinator: str | None,
                 hosts: int, host: int):
        if hosts > 1:
            initialize_distributed(coordinator, hosts, host)
        config = dataclasses.replace(config, data_parallel_size=1, data_parallel_backend="thread")
        engines, tokenizer = build_engines(config, chat_template, warmup=False, first_rank=rank)
        self.spec = EngineSpec.of(engines[0])
        self.engine = None
        if host:
            threading.Thread(target=engines[0].runner.follow, name="follower", daemon=True).start()
            return
        self.engine = AsyncEngine(engines[0], tokenizer)  # (its queue is bounded by the API's handle)
        self.engine.start()

    def describe(self) -> EngineSpec:
        return self.spec

    def snapshot(self) -> tuple:
        """(stats, queued, compile progress, ready, weight version) as of now. An engine whose loop died ends the
        actor's process, for Ray to start it again."""
        e = self.engine
        if not e.is_running and e.error is not None:
            log.error("the engine loop failed (%r): ending this replica's process for Ray to restart it", e.error)
            os._exit(1)
        return e.stats, e.admission.queued, e.compile_progress, e.is_ready and e.is_running, e.weight_version

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int, cache_salt: str | None, min_weight_version: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Update]:
        if params.constraint is not None:  # (compiled here, off the engine's thread, as the API does at home)
            await asyncio.to_thread(self.engine.check_constraint, params.constraint)
        async for update in self.engine.generate(request_id, prompt_token_ids, params, priority=priority,
                                                 cache_salt=cache_salt, min_weight_version=min_weight_version,
                                                 lora_request=lora_request):
            yield update

    async def call(self, method: str, *args) -> tuple:
        """(`AsyncEngine.call`'s result, the weight version after it)."""
        return await self.engine.call(method, *args), self.engine.weight_version

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams, lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        return await self.engine.beam_search(request_id, prompt_token_ids, params, lora_request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def abort_requests(self, api_ids: set[str] | None) -> None:
        self.engine.abort_requests(api_ids)

    def abort_all(self) -> None:
        self.engine.abort_all()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


class RayReplica:
    """The API's handle of a replica actor, with `AsyncEngine`'s interface (what `Replicas` calls):
    its figures from a poller thread, the bounded queue counted here, requests streamed from the
    actor. `spec`: what the actor's engine is (`EngineSpec`)."""

    def __init__(self, actors: list, rank: int, spec: EngineSpec, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None):
        """`actors`: the replica's, one per host, the engine's first (all kept: Ray ends an actor
        nobody holds a handle of)."""
        import ray

        self._ray, self.actors, self.rank, self.engine = ray, actors, rank, spec
        self.tokenizer = spec.tokenizer
        self.error: BaseException | None = None
        self._snapshot: tuple = (IDLE, (0, 0), (0, len(spec.config.step_buckets)), False, 0)
        self.admission = QueueBound(max_queued_requests, max_queued_tokens, lambda: self._snapshot[1])
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"replica-{rank}", daemon=True)

    @property
    def actor(self):
        """The actor that runs the engine (the first host's)."""
        return self.actors[0]

    def start(self) -> None:
        self._poller.start()

    def _poll(self) -> None:
        counted = IDLE  # the replica's counters before its last restart, added to those since
        while not self._stop.wait(POLL_SECONDS):
            asked = time.monotonic()
            try:
                stats, *rest = self._ray.get(self.actor.snapshot.remote(), timeout=10)
                if stats.num_generated_tokens < self._snapshot[0].num_generated_tokens - counted.num_generated_tokens:
                    counted = self._snapshot[0]  # (restarted: its counters start again from 0)
                self._snapshot = (with_counters(stats, counted), *rest)
                self.admission.arrived_before(asked)  # (the figures count what was sent before they were asked)
            except Exception as e:  # (dead, restarting, or slow: unready until it answers again)
                if self._snapshot[3]:
                    log.warning("replica %d does not answer (%s); requests go to the others", self.rank,
                                type(e).__name__)
                self._snapshot = (*self._snapshot[:3], False, self._snapshot[4])

    def shutdown(self, timeout: float = 10.0) -> bool:
        self._stop.set()
        try:
            self._ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception:  # (already gone)
            pass
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        return True

    @property
    def stats(self) -> SchedulerStats:
        return self._snapshot[0]

    @property
    def compile_progress(self) -> tuple[int, int]:
        return self._snapshot[2]

    @property
    def is_ready(self) -> bool:
        return self._snapshot[3]

    @property
    def is_running(self) -> bool:
        return not self._stop.is_set()  # (Ray restarts a dead actor: the replica runs until shut down)

    def check(self, prompt_token_ids: list[int], params: SamplingParams, **options) -> None:
        self.engine.checks.check_request(prompt_token_ids, params, **options)

    def check_constraint(self, constraint: Constraint) -> None:
        """ValueError for a constraint that does not compile: checked here, with the model's tokenizer."""
        compiled_grammars(self.tokenizer.hf, self.engine.model_config.vocab_size).compiled(constraint)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, min_weight_version: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Update]:
        """The actor's updates; ReplicaLost where it dies meanwhile (or is not there). Once sent, the
        request is counted here until figures asked for after that come back (`_poll`)."""
        unfinished = params.n
        try:
            with self._calling(request_id):
                self.admission.sent(request_id)
                stream = self.actor.generate.remote(request_id, prompt_token_ids, params, priority, cache_salt,
                                                    min_weight_version, lora_request)
                async for ref in stream:
                    update = await ref
                    unfinished -= update.finish_reason is not None
                    yield update
                if unfinished:  # (the stream of an actor that died may just end)
                    raise ReplicaLost(f"replica {self.rank}: its stream ended before the request did")
        finally:
            if unfinished:
                self.abort(request_id)

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams, lora_request: LoRARequest | None = None) -> BeamSearchOutput:
        with self._calling(request_id):
            search = self.actor.beam_search.remote(request_id, prompt_token_ids, params, lora_request)
            self.admission.arrived(request_id)  # (its rounds are requests of their own, counted there)
            return await search

    @contextlib.contextmanager
    def _calling(self, request_id: str):
        """Around a call of the actor for a request: Ray's errors as what they mean here, and the
        request no longer counted as queued here at its end."""
        try:
            yield
        except self._ray.exceptions.RayTaskError:
            raise  # (the request's own error, raised in the actor: also an instance of its cause)
        except self._ray.exceptions.RayError as e:  # (dead, restarting, its objects gone)
            raise ReplicaLost(f"replica {self.rank}: {type(e).__name__}") from e
        finally:
            self.admission.arrived(request_id)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)  # (fire and forget: a dead actor has nothing to abort)

    def abort_requests(self, api_ids: set[str] | None) -> None:
        self.actor.abort_requests.remote(api_ids)

    def abort_all(self) -> None:
        self.actor.abort_all.remote()

    @property
    def weight_version(self) -> int:
        """As of the last figures (`_poll`); the actor's own after a control (`call`)."""
        return self._snapshot[4]

    async def call(self, method: str, *args):
        """`AsyncEngine.call` on the actor's engine (the error it raises, raised here as itself)."""
        try:
            result, version = await self.actor.call.remote(method, *args)
        except self._ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        self._snapshot = (*self._snapshot[:4], version)
        return result


def start_ray_replicas(config: EngineConfig, chat_template: str | None, *, hosts: int = 1,
                       bundle: dict | None = None, address: str | None = None,
                       max_queued_requests: int | None = None, max_queued_tokens: int | None = None
                       ) -> list[RayReplica]:
    """`config.data_parallel_size` replicas on the Ray cluster at `address` (None: RAY_ADDRESS, or a
    running local cluster, else a new one), each spanning `hosts` hosts of `bundle` resources (None:
    `default_bundle`), started and ready to answer. Named "jaxserve-replica-R" in the "jaxserve"
    namespace."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    bundle = bundle or default_bundle(ray.cluster_resources(), config.tensor_parallel_size, hosts)
    # (a stream holds one of an async actor's concurrent calls for as long as it runs: room for many,
    # so that the handle's polls and aborts never wait behind them)
    actor_class = ray.remote(max_restarts=-1, max_task_retries=0, max_concurrency=MAX_CALLS)(ReplicaActor)
    groups = []
    for rank in range(config.data_parallel_size):
        bundles, strategy = placement(bundle, hosts)
        group = placement_group(bundles, strategy=strategy, name=f"jaxserve-replica-{rank}")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise ValueError(f"the Ray cluster has no room for replica {rank} ({hosts} x {bundle}) after "
                             f"{PLACEMENT_SECONDS} s: see `ray status`, and --ray-bundle") from None
        coordinator = None
        if hosts > 1:
            coordinator = ray.get(ray.remote(_coordinator_address).options(
                num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote())
        actors = [actor_class.options(
            name=f"jaxserve-replica-{rank}" + (f"-host-{host}" if host else ""), namespace=NAMESPACE,
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, host),
        ).remote(config, chat_template, rank, coordinator, hosts, host)
            for host in range(hosts)]
        groups.append(actors)
        log.info("replica %d: %d host(s) of %s placed by Ray", rank, hosts, bundle)
    specs = ray.get([actors[0].describe.remote() for actors in groups])  # (once their weights are loaded)
    return [RayReplica(actors, rank, spec, max_queued_requests, max_queued_tokens)
            for rank, (actors, spec) in enumerate(zip(groups, specs))]


def _coordinator_address() -> str:
    """HOST:PORT for `jax.distributed` on the node of a replica's first host."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"
