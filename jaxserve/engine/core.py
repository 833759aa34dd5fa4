"""The engine loop.

`Engine` owns the scheduler, the runner and the output processor and advances
them one step at a time (`step`: schedule, grammar masks, launch; then finish the
step launched before: update, release text). `build_engine` makes one from an
`EngineConfig`. The offline `LLM` (`jaxserve/llm.py`) and the API's engine thread
(`async_engine.py`) drive it; it knows nothing about HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from checkpoints import resolve_model
from jaxserve.config.engine import EngineConfig
from jaxserve.config.lora import LoRARequest
from jaxserve.engine.checks import RequestChecks, engine_processors
from jaxserve.engine.drafting import draft_tokens, propose, speculates
from jaxserve.engine.kv_events import KVEventPublisher
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import Update
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.errors import StepFailed
from jaxserve.models.config import ModelConfig
from jaxserve.sample.params import RequestSampling, SamplingParams
from jaxserve.sched.pages import salt_seed
from jaxserve.sched.plan import ScheduledBatch, SchedulerStats
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.sequence import Sequence
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.worker.draft import DraftModel
from jaxserve.worker.executables import compilation_cache
from jaxserve.worker.lora import AdapterStore, adapter_slots
from jaxserve.worker.runner import Runner
from jaxserve.worker.sharding import is_leader, kv_sharding, make_mesh, replicated
from jaxserve.worker.step_fn import LaunchedStep, Staged
from jaxserve.worker.warmup import BucketCompiler
from jaxserve.worker.weight_update import WeightLayout
from jaxserve.worker.weights import load_weights, weight_target

log = logging.getLogger(__name__)

WAKE_TAGS = ("weights", "kv_cache")  # what sleep frees and wake_up restores (vLLM's tags)
SCHEDULING = "scheduling"  # vLLM's wake_up tag of a pause (sleep level 0): its caller's, not the engine's


class InFlight(NamedTuple):
    """A step launched and not yet finished: its plan, and its outputs still on the device."""

    batch: ScheduledBatch
    launched: LaunchedStep


class Engine:
    """Scheduler + runner + output processor, and the step loop. Requests arrive as token ids."""

    def __init__(self, model_dir: str | Path, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | Future[Tokenizer] | None, *, warmup: bool = True,
                 sampling_defaults: dict | None = None, replica: int = 0, data_parallel_rank: int | None = None):
        """`tokenizer` may still be loading (a Future): it is needed only once the weights are loaded
        and the engine is warmed up (`warmup`; later, where `warmup` is False); None with
        `config.skip_tokenizer_init` (outputs are then token ids, with empty text). `sampling_defaults`
        (`config.sampling_defaults`): what the API and `LLM` give a request for the sampling fields
        it leaves out. `replica`: which of this process's `config.data_parallel_size` replicas this is
        (its devices); `data_parallel_rank`: which of all replicas (default: `replica`; a Ray replica's
        rank among all), the rank of its KV events."""
        executable_cache = compilation_cache()
        self.mesh = make_mesh(config.tensor_parallel_size, replica, config.data_parallel_size)
        model_config = model_config.parallel(config.enable_expert_parallel, config.tensor_parallel_size)
        self.model_config = model_config = model_config.for_context(config.max_model_len)
        self.config = config
        self.sampling_defaults = dict(sampling_defaults or {})
        self.processors = engine_processors(config, model_config.vocab_size)
        self.processors.check(config.max_model_len)  # (before the weights: a processor that fails, fails fast)
        started = time.monotonic()
        graphdef, state = load_weights(model_dir, model_config, config.dtype, self.mesh, config.quantization)
        log.info("loaded the weights in %.1f s", time.monotonic() - started)
        self.model_dir = model_dir
        # the layout of the step's weights, which new weights are brought into (`update_weights`)
        self.weight_layout = WeightLayout(state, weight_target(model_dir, model_config, config.dtype, self.mesh,
                                                         config.quantization)[2], config.dtype)
        self.weight_version = 0  # of the weights the engine runs (0: the checkpoint's; each update sets it)
        self._asleep: dict[str, object] = {}  # what `sleep` freed: "weights" (their host copy, or None), "kv_cache"
        self._reload_weights = False  # woken from level 2 without new weights yet (`wake_up`)
        spec = config.speculative
        draft = None
        if spec is not None and spec.model is not None:
            if jax.process_count() > 1:
                raise ValueError("speculative_config: a draft model runs on one host only")
            draft_dir = resolve_model(spec.model)
            draft = DraftModel(draft_dir, ModelConfig.from_hf(draft_dir), config, model_config, self.mesh,
                               executable_cache)
        self.runner = Runner(model_config, config, graphdef, state, kv_sharding(self.mesh, model_config),
                             replicated(self.mesh), executable_cache, self.processors, draft,
                             adapter_slots(model_config, config, self.mesh))
        self.scheduler = Scheduler(config, model_config.eos_token_ids)
        # the prefix cache's events, for external routers (--kv-events-config): one publisher per replica
        rank = replica if data_parallel_rank is None else data_parallel_rank
        self.kv_events = (KVEventPublisher(config.kv_events, rank, config.page_size)
                          if config.kv_events is not None and is_leader() else None)
        # what drafts tokens for speculative decoding: prompt lookup (a draft model is the runner's)
        self.proposer = NgramProposer(spec) if spec is not None and draft is None else None
        self._seeds = np.random.default_rng(config.seed)
        self._in_flight: InFlight | None = None
        self.compiler = BucketCompiler(self.runner, config.warmup_order)
        self.is_ready = False  # every step the scheduler may plan has a compiled bucket (`warmup`)
        if warmup:
            self.warmup()
        self.tokenizer = tokenizer.result() if isinstance(tokenizer, Future) else tokenizer
        self.output = OutputProcessor(self.tokenizer, self.scheduler, model_config.vocab_size)
        self.checks = RequestChecks(config, model_config, self.processors, self.tokenizer)
        # the scheduler's figures as of the last change, for other threads to read (metrics)
        self.stats: SchedulerStats = self.scheduler.stats()

    def warmup(self, background: bool = False, progress: bool = True) -> None:
        """Compile the step buckets (jaxserve/worker/warmup.py): all of them now, or with `background` the
        first of `EngineConfig.warmup_order` now and the others on background threads;
        `config.warmup` "all" or "minimal" decides over `background`. Process 0 of several runs every
        bucket now, so that the others compile theirs as they follow (they do nothing here)."""
        start = time.monotonic()
        if self.runner.draft is not None:
            self.runner.draft.compile_proposals()
        if jax.process_count() > 1:
            background = False
            if is_leader():
                self.runner.warmup_followers(progress)
        else:
            background = {"auto": background, "minimal": True, "all": False}[self.config.warmup]
            shapes = self.compiler.shapes
            # (a restart loads the buckets it compiled before in moments: all of those first)
            first = max(1, self.runner.cached_prefix(shapes)) if background else len(shapes)
            log.info("compiling (or loading from the executable cache) %d of %d step buckets before serving",
                     first, len(shapes))
            bar = progress and not background
            self.compiler.start(log_progress=not bar, background=background)
            self.compiler.wait(first, progress=bar)
        self.is_ready = True
        if background:
            log.info("ready to serve: %d of %d step buckets compiled in %.1f s; the others compile in the background",
                     self.compiler.num_compiled, len(self.compiler.shapes), time.monotonic() - start)

    @property
    def compile_progress(self) -> tuple[int, int]:
        """(step buckets compiled, step buckets)."""
        return len(self.runner.executables), len(self.config.step_buckets)

    def close(self) -> None:
        """Stop compiling in the background (after the buckets being compiled), and publishing KV events."""
        self.compiler.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> Sequence:
        """Queue a request: one sequence, which forks params.n - 1 siblings once its prompt is cached
        (`seq.forks`). ValueError for an empty, out-of-vocabulary or too long prompt (`check_request`)
        or a constraint that does not compile. `priority` (lower first) orders it under the priority
        scheduling policy; `cache_salt` keeps its prefix-cache pages apart from those of requests with
        another salt, or none (vLLM's). `lora_request`: the LoRA adapter it runs with (read from
        its files on first use: ValueError where it cannot be served, `check_adapter`)."""
        prompt_token_ids = params.truncate(prompt_token_ids, self.config.max_model_len)
        max_tokens = self.check_request(prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        self.check_adapter(lora_request)
        hidden_layers, steering = self.checks.residual(params)
        sampling = dataclasses.replace(RequestSampling.of(params, self.checks.encode, self.model_config.vocab_size,
                                                          self.processors), hidden_layers=hidden_layers,
                                       steering=steering)
        if params.constraint is not None:
            self.output.check_constraint(params.constraint)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       params=params, sampling=sampling, seed=seed, max_tokens=max_tokens, priority=priority,
                       hash_seed=salt_seed(cache_salt, lora_request and lora_request.lora_int_id,
                                           steering and steering.key), lora=lora_request)
        self.scheduler.add(seq)
        self.stats = self.scheduler.stats()
        return seq

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                      cache_salt: str | None = None) -> int:
        """`RequestChecks.check_request`: the request's max_tokens, or ValueError."""
        return self.checks.check_request(prompt_token_ids, params, priority=priority, cache_salt=cache_salt)

    def check_adapter(self, lora_request: LoRARequest | None) -> None:
        """ValueError unless the adapter (if any) can be served: LoRA is on, and its files read
        (kept in host memory from then on, `AdapterStore`). Any thread may call it."""
        if lora_request is not None:
            self.adapter_store(lora_request.lora_name).get(lora_request)

    def adapter_store(self, name: str = "") -> AdapterStore:
        """The adapters read into host memory; ValueError (about adapter `name`) without enable_lora."""
        if self.runner.adapters is None:
            raise ValueError(f"LoRA adapter {name!r}: this engine serves no adapters (start it with enable_lora)")
        return self.runner.adapters.store

    def abort(self, request_id: str, reason: str = "abort") -> list[Sequence]:
        """End the request's unfinished sequences now (finish reason `reason`) -> them."""
        seqs = [s for s in self.scheduler.seqs.values() if s.request_id == request_id]
        for seq in seqs:
            self.scheduler.finish(seq.seq_id, reason)
            self.output.forget(seq.seq_id)
        self.stats = self.scheduler.stats()
        return seqs

    # --- new weights and sleep mode, between steps (the API's engine thread, or `LLM`) ---

    def update_weights(self, leaves: list[jax.Array], weight_version: int,
                       on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """Run on `leaves` (the step's weights, whole: `WeightLayout.leaves`) from the next step on,
        under `weight_version`. The step in flight finishes first (its tokens are the old weights');
        the running sequences drop their KV, the old weights', and recompute it (preempted); the
        prefix cache is reset. -> what the step in flight released."""
        if jax.process_count() > 1:
            raise ValueError("new weights reach one process's engine only: a multi-host replica keeps its weights")
        released = self.preempt_running(on_release)
        self.runner.weights = leaves  # (one swap: no step runs on half of them)
        self._asleep.pop("weights", None)
        self._reload_weights = False
        if not self.scheduler.allocator.reset_prefix_cache():  # (nothing runs now: it cannot refuse)
            raise RuntimeError("the prefix cache kept pages of the old weights")
        self._set_version(weight_version)
        return released

    def _set_version(self, version: int) -> None:
        self.weight_version = int(version)
        self.stats = self.scheduler.stats()

    def drain(self, on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """Finish the step in flight, if any -> what it released."""
        if self._in_flight is None:
            return []
        try:
            return self._finish_in_flight(on_release)
        except Exception as e:
            raise StepFailed(self._fail(None), e) from e

    def sleep(self, level: int = 1, on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """vLLM's sleep mode: free the KV cache and, at level 2, the weights too (level 1 keeps a host copy
        of them); the compiled steps stay. (Level 0, a pause alone, is the caller's.) -> `preempt_running`'s."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache, keep the weights on the host) or 2 (free "
                             f"both), not {level}")
        released = self.release_kv_cache(on_release)
        if "weights" not in self._asleep and not self._reload_weights:
            self._asleep["weights"] = self.weight_layout.to_host(self.runner.weights) if level == 1 else None
            self.runner.release_weights()
        return released

    def release_kv_cache(self, on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """Free the KV cache alone (vLLM's release_kv_cache_memory; `wake_up(["kv_cache"])` restores it).
        -> `preempt_running`'s."""
        released = self.preempt_running(on_release)
        self.scheduler.allocator.reset_prefix_cache()
        if "kv_cache" not in self._asleep:
            self.runner.release_kv()
            self._asleep["kv_cache"] = None
        self.stats = self.scheduler.stats()
        return released

    def preempt_running(self, on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """Finish the step in flight, drop the running sequences' KV (to recompute) -> what the step released."""
        released = self.drain(on_release)
        self.scheduler.preempt_all()
        self.stats = self.scheduler.stats()
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `sleep` freed (`tags`: "weights", "kv_cache"; default both). Weights freed at
        level 2 come back as new ones (`update_weights`, woken or not) or, where none came by the time
        all is awake, reloaded from the checkpoint, whose version is 0."""
        tags = set(tags or WAKE_TAGS) - {SCHEDULING}
        if unknown := tags - set(WAKE_TAGS):
            raise ValueError(f"wake_up tags {sorted(unknown)}: choose from {[*WAKE_TAGS, SCHEDULING]}")
        if "weights" in tags and "weights" in self._asleep:
            host = self._asleep.pop("weights")
            if host is None:
                self._reload_weights = True  # (new weights may come before the cache wakes: vLLM's way)
            else:
                self.runner.weights = self.weight_layout.from_host(host)
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.runner.allocate_kv()
            del self._asleep["kv_cache"]
        if self._reload_weights and not self._asleep:
            log.warning("awake after sleep level 2 with no new weights: they reload from %s (weight version 0)",
                        self.model_dir)
            self.runner.weights = self.weight_layout.leaves(self.weight_layout.from_checkpoint(self.model_dir))
            self._reload_weights = False
            self._set_version(0)

    @property
    def is_sleeping(self) -> bool:
        """Whether the KV cache or the weights are freed (`sleep`): no step runs until `wake_up`."""
        return bool(self._asleep) or self._reload_weights

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, on_release: Callable[[Update], None] | None = None,
             arrivals: Callable[[], bool] | None = None) -> list[Update]:
        """Launch the next step, then finish the one launched before it -> the text released for each
        sequence that got a token in that one.

        The next step is planned and launched before the previous step's tokens reach the host (its
        rows read them on the device, see `scheduler`), so the host's work on them (recording tokens,
        detokenizing, stop strings, and `on_release` of each output, e.g. sending it to a client)
        runs while the device computes. It is finished first when its tokens feed the host side of the
        next (a grammar's mask), or when it held prompt chunks alone (their first tokens go out sooner).

        `arrivals` (a server's): called once the step before has computed, to add the requests that
        came meanwhile -> whether any did. Where the device is the host's CPU (`Runner.shares_host`:
        launching early gains little there) and several sequences run (`_holds`), the next step is
        launched only then, and they join it (`Scheduler.admit`): a new prompt waits for the step in
        flight, not also for one queued behind it."""
        if not self.is_ready:
            raise RuntimeError("the engine's steps are not compiled yet: call Engine.warmup first")
        if self.is_sleeping:
            raise RuntimeError("the engine is asleep (its KV cache or weights are freed): call wake_up first")
        released, batch = [], None
        try:
            speculate = speculates(self.config, self.scheduler.running)
            before = None if self._in_flight is None else self._in_flight.batch
            if before is not None and (speculate or before.prefill_only  # (drafts follow the last token)
                                       or not self.scheduler.can_schedule_ahead(before)):
                released = self._finish_in_flight(on_release)
            drafts = draft_tokens(self.config, self.scheduler.running, self.proposer) if speculate else None
            batch = self.scheduler.schedule(self.runner.token_budget(), drafts)
            if self.runner.draft is not None and batch.num_samples > len(batch.rows):
                propose(self.runner.draft, batch)
            in_flight = None
            if batch.rows:
                self.output.constrain(batch)
                staged = self.runner.stage(batch)
                if arrivals is not None and self._holds(batch):
                    staged = self._admit_arrivals(batch, arrivals) or staged
                in_flight = InFlight(batch, self.runner.launch(batch, staged))
            if self._in_flight is not None:
                released = self._finish_in_flight(on_release)  # (its stats snapshot sees this schedule too)
            else:
                self.stats = self.scheduler.stats()
            self._in_flight = in_flight
        except Exception as e:
            raise StepFailed(self._fail(batch), e) from e
        finally:
            if self.kv_events is not None:
                self.kv_events.publish(self.scheduler.allocator.take_events())
        return released

    def _holds(self, batch: ScheduledBatch) -> bool:
        """Whether `batch`, planned behind the step in flight, waits for it to compute before launching
        (`step`'s `arrivals`): where the device is the host's CPU, and not behind a lone sequence's
        step (the shortest an arrival could wait for, and the one an unhidden launch costs most)."""
        return self._in_flight is not None and self.runner.shares_host and len(batch.rows) > 1

    def _admit_arrivals(self, batch: ScheduledBatch, arrivals: Callable[[], bool]) -> Staged | None:
        """Wait for the step in flight; add the requests that came meanwhile into `batch` -> its
        inputs again where some joined it."""
        self.runner.wait(self._in_flight.launched)
        if not arrivals() or not self.scheduler.admit(batch):
            return None
        self.output.constrain(batch)  # (the new rows' masks)
        return self.runner.stage(batch)

    def _fail(self, batch: ScheduledBatch | None) -> list[str]:
        """After a step raised: end (finish reason "error") the requests of the step being planned and
        of the one in flight, which may have been half recorded -> their ids."""
        rows = [*(batch.rows if batch is not None else ()),
                *(self._in_flight.batch.rows if self._in_flight is not None else ())]
        self._in_flight = None
        failed = {seq.request_id for row in rows if (seq := self.scheduler.seqs.get(row.seq_id)) is not None}
        for request_id in failed:
            self.abort(request_id, "error")
        return sorted(failed)

    def _finish_in_flight(self, on_release: Callable[[Update], None] | None) -> list[Update]:
        in_flight = self._in_flight
        changed = self.scheduler.update(in_flight.batch, self.runner.collect(in_flight.batch, in_flight.launched))
        self._in_flight = None  # (not before: a step that fails here fails its requests, `_fail`)
        self.output.advance_grammars(changed)
        # (a stop string found here drops the sequence's row; an update of the weights waits for this step)
        released = self.output.process(changed, self.weight_version)
        self.stats = self.scheduler.stats()  # before any release: whoever hears of a finish sees it counted
        for out in released if on_release else ():  # in the step already launched
            on_release(out)
        return released


