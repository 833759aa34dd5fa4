"""The engine loop.

`Engine` owns the scheduler, the runner and the output processor and advances
them one step at a time (`step`: schedule, grammar masks, launch; then finish the
step launched before: update, release text). `build_engine` makes one from an
`EngineConfig`. The offline `LLM` (`jaxserve/llm.py`) and the API's engine thread
(`async_engine.py`) drive it; it knows nothing about HTTP.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from checkpoints import resolve_model
from jaxserve.config.engine import MAX_LOGPROBS, EngineConfig
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import Update
from jaxserve.engine.tokenizer import Tokenizer
from jaxserve.errors import RequestError, StepFailed
from jaxserve.models.config import ModelConfig
from jaxserve.sample.llamacpp import BUILTIN_SAMPLERS
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.params import RequestSampling, SamplingParams
from jaxserve.sample.tensors import MAX_SUPPRESSED, needs_distribution
from jaxserve.sched.plan import ScheduledBatch, SchedulerStats
from jaxserve.sched.scheduler import Scheduler
from jaxserve.sched.sequence import Sequence, SequenceStatus
from jaxserve.spec_decode.ngram import NgramProposer
from jaxserve.worker.draft import DraftModel
from jaxserve.worker.executables import compilation_cache
from jaxserve.worker.runner import Runner
from jaxserve.worker.sharding import is_leader, kv_sharding, make_mesh, replicated
from jaxserve.worker.step_fn import LaunchedStep
from jaxserve.worker.warmup import BucketCompiler
from jaxserve.worker.weights import load_weights

log = logging.getLogger(__name__)


class InFlight(NamedTuple):
    """A step launched and not yet finished: its plan, and its outputs still on the device."""

    batch: ScheduledBatch
    launched: LaunchedStep


class Engine:
    """Scheduler + runner + output processor, and the step loop. Requests arrive as token ids."""

    def __init__(self, model_dir: str | Path, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | Future[Tokenizer] | None, *, warmup: bool = True,
                 sampling_defaults: dict | None = None):
        """`tokenizer` may still be loading (a Future): it is needed only once the weights are loaded
        and the engine is warmed up (`warmup`; later, where `warmup` is False); None with
        `config.skip_tokenizer_init` (outputs are then token ids, with empty text). `sampling_defaults`
        (`config.sampling_defaults`): what the API and `LLM` give a request for the sampling fields
        it leaves out."""
        executable_cache = compilation_cache()
        self.mesh = make_mesh(config.tensor_parallel_size)
        model_config = model_config.parallel(config.enable_expert_parallel, config.tensor_parallel_size)
        self.model_config = model_config = model_config.for_context(config.max_model_len)
        self.config = config
        self.sampling_defaults = dict(sampling_defaults or {})
        self.processors = Processors([*BUILTIN_SAMPLERS, *config.logits_processors], model_config.vocab_size)
        self.processors.check(config.max_model_len)  # (before the weights: a processor that fails, fails fast)
        started = time.monotonic()
        graphdef, state = load_weights(model_dir, model_config, config.dtype, self.mesh, config.quantization)
        log.info("loaded the weights in %.1f s", time.monotonic() - started)
        spec = config.speculative
        draft = None
        if spec is not None and spec.model is not None:
            if jax.process_count() > 1:
                raise ValueError("speculative_config: a draft model runs on one host only")
            draft_dir = resolve_model(spec.model)
            draft = DraftModel(draft_dir, ModelConfig.from_hf(draft_dir), config, model_config, self.mesh,
                               executable_cache)
        self.runner = Runner(model_config, config, graphdef, state, kv_sharding(self.mesh, model_config),
                             replicated(self.mesh), executable_cache, self.processors, draft)
        self.scheduler = Scheduler(config, model_config.eos_token_ids)
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
        """Stop compiling in the background (after the buckets being compiled)."""
        self.compiler.close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None) -> Sequence:
        """Queue a request: one sequence, which forks params.n - 1 siblings once its prompt is cached
        (`seq.forks`). ValueError for an empty, out-of-vocabulary or too long prompt (`check_request`)
        or a constraint that does not compile. `priority` (lower first) orders it under the priority
        scheduling policy; `cache_salt` keeps its prefix-cache pages apart from those of requests with
        another salt, or none (vLLM's)."""
        prompt_token_ids = params.truncate(prompt_token_ids, self.config.max_model_len)
        max_tokens = self.check_request(prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        sampling = RequestSampling.of(params, self._encode,
                                      self.model_config.vocab_size, self.processors)
        if params.constraint is not None:
            self.output.check_constraint(params.constraint)
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**63))
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                       params=params, sampling=sampling, seed=seed, max_tokens=max_tokens, priority=priority,
                       hash_seed=None if cache_salt is None else hashlib.sha256(
                           b"cache_salt\0" + cache_salt.encode()).digest())
        self.scheduler.add(seq)
        self.stats = self.scheduler.stats()
        return seq

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0,
                      cache_salt: str | None = None) -> int:
        """The request's max_tokens, or ValueError for what this engine cannot run (all but the
        constraint), for the prompt as it runs (truncated: `SamplingParams.truncate`). Reads only
        the configuration: any thread may call it, e.g. to refuse a streamed request before its
        response starts."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestError(f"priority must be an integer, got {priority!r}", "priority")
        if priority and self.config.scheduling_policy != "priority":
            raise RequestError(f"Got priority {priority} but priority scheduling is not enabled (the scheduling "
                               "policy is fcfs: start the engine with --scheduling-policy priority)", "priority")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise RequestError("cache_salt must be a non-empty string", "cache_salt")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_token_ids)
            if max_tokens < 1:
                raise RequestError(f"This model's maximum context length is {self.config.max_model_len} tokens, "
                                   f"but the request has {len(prompt_token_ids)} prompt tokens, which leave no room "
                                   "for an output token. Shorten the prompt.", "prompt")
        self.config.check_fits(len(prompt_token_ids), max_tokens)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise RequestError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})", name)
        if self.config.skip_tokenizer_init and params.text_settings:
            name = params.text_settings[0]
            raise RequestError(f"{name} needs the model's tokenizer, and the engine runs without one "
                               "(skip_tokenizer_init): on token ids alone, stop_token_ids, logit_bias and "
                               "allowed_token_ids serve instead", name)
        self._check_logprobs(params)
        self.processors.request_args(params, self._encode)  # (a ValueError: the request's error)
        suppressed = set(params.stop_token_ids) | set(self.model_config.eos_token_ids)
        if params.min_tokens and len(suppressed) > MAX_SUPPRESSED:
            raise ValueError(f"min_tokens can hold back at most {MAX_SUPPRESSED} EOS and stop token ids, "
                             f"got {len(suppressed)}")
        return max_tokens

    def _check_logprobs(self, params: SamplingParams) -> None:
        """Top logprobs up to max_logprobs (-1: the vocabulary's size, in either), as vLLM's; prompt
        logprobs up to the MAX_LOGPROBS the step computes per prompt token."""
        vocab, cap = self.model_config.vocab_size, self.config.max_logprobs
        if params.prompt_logprobs is not None and needs_distribution(params.prompt_logprobs):
            raise RequestError(f"requested prompt logprobs of {params.prompt_logprobs}: at most {MAX_LOGPROBS} per "
                               "prompt token are supported (more, or -1, only for sampled tokens' logprobs)",
                               "prompt_logprobs")
        for name, field, value in (("sample logprobs", "logprobs", params.logprobs),
                                   ("prompt logprobs", "prompt_logprobs", params.prompt_logprobs)):
            wanted = vocab if value == -1 else value
            if value is None or wanted <= (vocab if cap == -1 else cap):
                continue
            if cap == -1:
                raise RequestError(f"requested {name} of {value}, more than the vocabulary's {vocab} tokens", field)
            more = " (-1: the whole vocabulary)" if value == -1 else ""
            raise RequestError(f"requested {name} of {value}{more}, more than max_logprobs ({cap}): raise "
                               "--max-logprobs (LLM's max_logprobs; -1: no cap)", field)

    @property
    def _encode(self) -> Callable[[str], list[int]] | None:
        """text -> token ids, no special tokens; None on token ids alone (skip_tokenizer_init)."""
        tokenizer = self.tokenizer
        return None if tokenizer is None else (lambda text: tokenizer.encode(text, add_special_tokens=False))

    def abort(self, request_id: str, reason: str = "abort") -> list[Sequence]:
        """End the request's unfinished sequences now (finish reason `reason`) -> them."""
        seqs = [s for s in self.scheduler.seqs.values() if s.request_id == request_id]
        for seq in seqs:
            self.scheduler.finish(seq.seq_id, reason)
            self.output.forget(seq.seq_id)
        self.stats = self.scheduler.stats()
        return seqs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self, on_release: Callable[[Update], None] | None = None) -> list[Update]:
        """Launch the next step, then finish the one launched before it -> the text released for each
        sequence that got a token in that one.

        The next step is planned and launched before the previous step's tokens reach the host (its
        rows read them on the device, see `scheduler`), so the host's work on them (recording tokens,
        detokenizing, stop strings, and `on_release` of each output, e.g. sending it to a client)
        runs while the device computes. Only when the previous step's tokens feed the host side of
        the next (a grammar's mask) is it finished first."""
        if not self.is_ready:
            raise RuntimeError("the engine's steps are not compiled yet: call Engine.warmup first")
        released, batch = [], None
        try:
            speculate = self.config.speculative is not None and self._speculates()
            if self._in_flight is not None and (speculate or not self.scheduler.can_schedule_ahead(
                    self._in_flight.batch)):  # (drafts follow the last token: it must be known)
                released = self._finish_in_flight(on_release)
            batch = self.scheduler.schedule(self.runner.token_budget(), self._drafts() if speculate else None)
            if self.runner.draft is not None and batch.num_samples > len(batch.rows):
                self._propose(batch)
            in_flight = None
            if batch.rows:
                self.output.constrain(batch)
                in_flight = InFlight(batch, self.runner.launch(batch))
            if self._in_flight is not None:
                released = self._finish_in_flight(on_release)  # (its stats snapshot sees this schedule too)
            else:
                self.stats = self.scheduler.stats()
            self._in_flight = in_flight
        except Exception as e:
            raise StepFailed(self._fail(batch), e) from e
        return released

    def _speculates(self) -> bool:
        """Whether this step drafts: while few enough sequences run that checking drafts costs less
        than it saves (`SpeculativeConfig.disable_by_batch_size`), and one of them decodes and may
        draft (`_drafts`)."""
        running = self.scheduler.running
        return 0 < len(running) <= self.config.speculative.disable_by_batch_size and any(
            self._may_draft(seq) and seq.num_computed_tokens >= seq.num_tokens - 1 for seq in running)

    @staticmethod
    def _may_draft(seq: Sequence) -> bool:
        """Not under a grammar or a logits processor that carries state from token to token: the
        next token's mask or state needs the token before it on the host."""
        return seq.params.constraint is None and not seq.sampling.carries

    def _drafts(self) -> dict[int, list[int]]:
        """Draft tokens for the running sequences whose next step computes just their last token
        (`_may_draft`): up to num_speculative_tokens, no more than their max_tokens and
        max_model_len leave room for. A draft model's are placeholders here, made once the step is
        planned (`_propose`: its rows' pages are then there for their K/V)."""
        k, max_len = self.config.speculative.num_speculative_tokens, self.config.max_model_len
        drafts = {}
        for seq in self.scheduler.running:
            if (seq.status is not SequenceStatus.RUNNING or seq.num_pending
                    or seq.num_computed_tokens != seq.num_tokens - 1 or not self._may_draft(seq)):
                continue
            room = min(k, seq.max_tokens - seq.num_output_tokens - 1, max_len - seq.num_tokens - 1)
            if room < 1:
                continue
            proposal = [0] * room if self.runner.draft is not None else self.proposer.propose(seq.token_ids, room)
            if proposal:
                drafts[seq.seq_id] = proposal[:room]
        return drafts

    def _propose(self, batch: ScheduledBatch) -> None:
        rows = [row for row in batch.rows if row.draft_token_ids]
        proposals = self.runner.draft.propose([(row.token_ids[0], row.start_position, row.page_ids) for row in rows])
        for row, proposal in zip(rows, proposals):
            row.set_drafts(proposal)

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
        released = self.output.process(changed)  # a stop string found here drops the sequence's row
        self.stats = self.scheduler.stats()  # before any release: whoever hears of a finish sees it counted
        for out in released if on_release else ():  # in the step already launched
            on_release(out)
        return released


