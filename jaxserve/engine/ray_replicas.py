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

import dataclasses
import logging
import socket
import threading
from collections.abc import AsyncIterator

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.admission import QueueBound
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.beam_search import BeamSearchOutput, BeamSearchParams
from jaxserve.engine.build import EngineSpec, build_engines
from jaxserve.engine.outputs import Update
from jaxserve.errors import ReplicaLost
from jaxserve.sample.params import SamplingParams
from jaxserve.sched.plan import SchedulerStats
from jaxserve.structured_output.grammar import Constraint, compiled_grammars
from jaxserve.worker.sharding import initialize_distributed

log = logging.getLogger(__name__)

NAMESPACE = "jaxserve"
POLL_SECONDS = 0.2  # how often a handle reads its replica's figures
IDLE = SchedulerStats(0, 0, 0, 1, 0, 0, 0, 0, 0, {})  # a replica's figures before it answers


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
        """(stats, queued, compile progress, ready) as of now."""
        e = self.engine
        return e.stats, e.admission.queued, e.compile_progress, e.is_ready and e.is_running

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int, cache_salt: str | None) -> AsyncIterator[Update]:
        async for update in self.engine.generate(request_id, prompt_token_ids, params, priority=priority,
                                                 cache_salt=cache_salt):
            yield update

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams) -> BeamSearchOutput:
        return await self.engine.beam_search(request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def abort_all(self) -> None:
        self.engine.abort_all()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


class RayReplica:
    """The API's handle of a replica actor, with `AsyncEngine`'s interface (what `Replicas` calls):
    its figures from a poller thread, the bounded queue counted here, requests streamed from the
    actor. `spec`: what the actor's engine is (`EngineSpec`)."""

    def __init__(self, actor, rank: int, spec: EngineSpec, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None):
        import ray

        self._ray, self.actor, self.rank, self.engine = ray, actor, rank, spec
        self.tokenizer = spec.tokenizer
        self.error: BaseException | None = None
        self._snapshot: tuple = (IDLE, (0, 0), (0, len(spec.config.step_buckets)), False)
        self.admission = QueueBound(max_queued_requests, max_queued_tokens, lambda: self._snapshot[1])
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"replica-{rank}", daemon=True)

    def start(self) -> None:
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._snapshot = self._ray.get(self.actor.snapshot.remote(), timeout=10)
            except Exception as e:  # (dead, restarting, or slow: unready until it answers again)
                if self._snapshot[3]:
                    log.warning("replica %d does not answer (%s); requests go to the others", self.rank,
                                type(e).__name__)
                self._snapshot = (*self._snapshot[:3], False)

    def shutdown(self, timeout: float = 10.0) -> bool:
        self._stop.set()
        try:
            self._ray.get(self.actor.shutdown.remote(), timeout=timeout)
        except Exception:  # (already gone)
            pass
        self._ray.kill(self.actor, no_restart=True)
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
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[Update]:
        """The actor's updates; ReplicaLost where it dies meanwhile (or is not there). Once sent, the
        request is counted as queued in the actor's figures (as of the handle's next poll), not here."""
        unfinished = params.n
        try:
            stream = self.actor.generate.remote(request_id, prompt_token_ids, params, priority, cache_salt)
            self.admission.arrived(request_id)
            async for ref in stream:
                update = await ref
                unfinished -= update.finish_reason is not None
                yield update
            if unfinished:  # (the stream of an actor that died may just end)
                raise ReplicaLost(f"replica {self.rank}: its stream ended before the request did")
        except self._ray.exceptions.RayTaskError:
            raise  # (the request's own error, raised in the actor: also an instance of its cause)
        except self._ray.exceptions.RayError as e:  # (dead, restarting, its objects gone)
            raise ReplicaLost(f"replica {self.rank}: {type(e).__name__}") from e
        finally:
            self.admission.arrived(request_id)
            if unfinished:
                self.abort(request_id)

    async def beam_search(self, request_id: str, prompt_token_ids: list[int],
                          params: BeamSearchParams) -> BeamSearchOutput:
        try:
            return await self.actor.beam_search.remote(request_id, prompt_token_ids, params)
        except self._ray.exceptions.RayTaskError:
            raise  # (the request's own error, raised in the actor: also an instance of its cause)
        except self._ray.exceptions.RayError as e:  # (dead, restarting, its objects gone)
            raise ReplicaLost(f"replica {self.rank}: {type(e).__name__}") from e
        finally:
            self.admission.arrived(request_id)

    def abort(self, request_id: str) -> None:
        self.actor.abort.remote(request_id)  # (fire and forget: a dead actor has nothing to abort)

    def abort_all(self) -> None:
        self.actor.abort_all.remote()


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
    actor_class = ray.remote(max_restarts=-1, max_task_retries=0)(ReplicaActor)
    leaders = []
    for rank in range(config.data_parallel_size):
        bundles, strategy = placement(bundle, hosts)
        group = placement_group(bundles, strategy=strategy, name=f"jaxserve-replica-{rank}")
        ray.get(group.ready())
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
        leaders.append(actors[0])
        log.info("replica %d: %d host(s) of %s placed by Ray", rank, hosts, bundle)
    specs = ray.get([leader.describe.remote() for leader in leaders])  # (once their weights are loaded)
    return [RayReplica(leader, rank, spec, max_queued_requests, max_queued_tokens)
            for rank, (leader, spec) in enumerate(zip(leaders, specs))]


def _coordinator_address() -> str:
    """HOST:PORT for `jax.distributed` on the node of a replica's first host."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"
