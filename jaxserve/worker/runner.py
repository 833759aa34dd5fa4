"""The device side of a step: pad the plan to a shape bucket, run one jitted call.

`make_step_fn` (`step_fn.py`) builds the only jitted entry point: model forward (KV written into the
donated cache) and the sampler, for one padded batch. Its shapes come from
`EngineConfig`'s buckets (tokens T, sequences B, page table width P: `step_buckets`);
`compile` compiles one (T, B, P) triple ahead of time (or loads it from the executable cache,
`executables.py`; `warmup.py` decides which and when), and a step runs the smallest compiled
bucket that fits it (`shape`), within a token budget that some compiled bucket fits
(`token_budget`), so serving never compiles. The runner reads nothing but the scheduler's plan.

Across hosts, process 0's runner sends each step's command and padded plan to the others
(`broadcast_plan`), which run the same jitted call in `follow` until it sends STOP.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from jaxserve_kernels.matmul import kernels_run

from jaxserve.config.engine import MAX_LOGPROBS, EngineConfig
from jaxserve.config.fields import compiled_fields
from jaxserve.models import LoraRows, ModelInputs, ReadRows, rope_table
from jaxserve.models.config import ModelConfig
from jaxserve.sample.logits_processors import Processors, fingerprint
from jaxserve.sample.tensors import Padding, SampleOutput, SamplingRow, SamplingTensors, needs_distribution
from jaxserve.sched.pages import NULL_PAGE
from jaxserve.sched.plan import ScheduledBatch, StepOutput, hidden_layer_slots, prompt_targets
from jaxserve.worker.draft import DraftModel
from jaxserve.worker.executables import ExecutableCache
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve.worker.lora import AdapterSlots
from jaxserve.worker.sharding import broadcast_plan, is_leader, place
from jaxserve.worker.steering import SteeringSlots, steering_slots
from jaxserve.worker.step_fn import LaunchedStep, PackedPlan, Staged, StepInputs, make_step_fn

# Commands process 0 broadcasts to the other processes: [command, tokens, sequences, page-table width].
RUN, KEEPALIVE, STOP = 0, 1, 2
KEEPALIVE_S = 10.0  # an idle leader still broadcasts this often, so no follower waits in a collective for long


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    """What compiling needs of an argument (an array a step may donate meanwhile still has these)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Runner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, graphdef: nnx.GraphDef, state: nnx.State,
                 kv_sharding: NamedSharding, replicated: NamedSharding, executable_cache: ExecutableCache,
                 processors: Processors, draft: DraftModel | None = None, adapters: AdapterSlots | None = None):
        self.model_config = model_config
        self.config = config
        self.graphdef = graphdef
        self.kv_sharding = kv_sharding
        self.kv = allocate_kv_cache(model_config, config, kv_sharding)
        self.weights, self._state_treedef = jax.tree.flatten(state)  # (the weights: replaced by an update)
        self.processors = processors  # the engine's logits processors, traced into the step
        self.draft = draft  # speculative decoding's draft model: each step's tokens go through it too
        self.adapters = adapters  # the LoRA slots (--enable-lora): each row runs with its sequence's adapter
        self.num_hidden, num_steering = config.residual_limits[0], steering_slots(config)
        # the steering slots (--max-steering-slots): each row adds its sequence's steering
        self.steering = SteeringSlots(model_config, num_steering, config.dtype, replicated) if num_steering else None
        # (read once: inspect's source lookup is not safe on the threads that compile)
        self._processors_fingerprint = fingerprint(processors.instances)
        self.step_fn = make_step_fn(graphdef, self._state_treedef, kv_sharding, replicated, config.logprobs_mode,
                                    processors, config.returns_distributions, config.batch_invariant,
                                    self.num_hidden)
        self.executable_cache = executable_cache
        self.executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}  # step bucket -> step
        self.replicated = replicated  # where host inputs of the step live (every device of the mesh)
        self._paddings: dict[Padding, jax.Array] = {}  # device copies of the inputs no row uses
        self._layouts: dict[tuple[int, int, int], tuple] = {}  # step bucket -> its PackedPlan layout
        self._previous = place(np.zeros(config.max_num_samples, np.int32), replicated)  # the last step's tokens
        self._leads = jax.process_count() > 1 and is_leader()  # process 0 of several: it broadcasts each step
        # the device is the host's CPU: launching a step behind the one computing takes the cores it computes on
        self.shares_host = replicated.mesh.devices.flat[0].platform == "cpu"
        # the last layer computes only the rows the step reads (`ModelInputs.read_rows`) where the kernels
        # skip rows; adapters' rows would need their slots in that order too
        self.reads_rows = kernels_run(replicated.mesh.size) and adapters is None and not config.batch_invariant
        self._last_broadcast = time.monotonic()

    @property
    def state(self) -> nnx.State:
        """The model's state holding the weights the steps run on now."""
        return jax.tree.unflatten(self._state_treedef, self.weights)

    def launch(self, batch: ScheduledBatch, staged: Staged | None = None) -> LaunchedStep:
        """Dispatch the step (`staged`: its inputs, made by `stage` for this batch as it is now);
        returns at once with the outputs still being computed on the device."""
        return self._run(*(staged or self.stage(batch)))

    def stage(self, batch: ScheduledBatch) -> Staged:
        """The step's bucket and host inputs: all `launch` needs but the device."""
        shape = self.shape(batch)
        slots = {} if self.adapters is None else self.adapters.assign(row.lora for row in batch.rows if row.lora)
        steered = [row.sampling.steering for row in batch.rows if row.sampling.steering is not None]
        slots.update(self.steering.assign(steered) if steered else {})
        return Staged(shape, self.prepare(batch, shape, slots))

    def _run(self, shape: tuple[int, int, int], inputs: StepInputs) -> LaunchedStep:
        if self._leads:  # the other processes run the same step on the same inputs
            self._command(RUN, shape)
            broadcast_plan(jax.tree.map(np.asarray, inputs))  # (paddings as arrays)
        args = self._args(inputs, shape)
        self.kv, launched, self._previous = self._executable(shape, args)(*args)
        if self.draft is not None:
            self.draft.mirror(shape, *args[2:4])
        return launched

    def _args(self, inputs: StepInputs, shape: tuple[int, int, int]) -> tuple:
        """The step's arguments: the host inputs packed (`PackedPlan`) and replicated on the mesh, the
        same way every step, in one transfer; a large input no row uses (a `Padding`) goes to the
        device only once. A single process hands the host arrays to the compiled step, which places them
        itself (less host CPU per step than placing them first); the compiling call and
        several processes place them (`place`), so the executable's inputs are always replicated."""
        leaves, treedef = jax.tree.flatten(inputs)
        if shape not in self._layouts:
            self._layouts[shape] = PackedPlan.layout_of(leaves)
        layout = self._layouts[shape]
        large = [leaf for leaf, (_, _, offset) in zip(leaves, layout) if offset < 0]
        fresh = [i for i, leaf in enumerate(large) if not isinstance(leaf, Padding)]
        words, *placed = host = [PackedPlan.words_of(leaves, layout), *[large[i] for i in fresh]]
        if jax.process_count() > 1 or shape not in self.executables:
            words, *placed = place(host, self.replicated)
        placed = dict(zip(fresh, placed))
        large = tuple(placed[i] if i in placed else self.padding_on_device(leaf) for i, leaf in enumerate(large))
        plan = PackedPlan(words=words, large=large, layout=layout, treedef=treedef)
        return (self.weights, self.kv, plan, self._previous, None if self.adapters is None else self.adapters.stacks,
                None if self.steering is None else self.steering.table)

    def _executable(self, shape: tuple[int, int, int], args: tuple) -> jax.stages.Compiled:
        """The step compiled for `shape` (whose arguments look like `args`): compiled on first use
        only by the processes of a multi-host job (`warmup_followers`); one process steps only
        through compiled buckets (`shape`)."""
        if shape not in self.executables:
            self.executables[shape] = self._compile(shape, args)
        return self.executables[shape]

    def _description(self, shape: tuple[int, int, int]) -> str:
        # (what only the host reads is left out: changing it needs no new executable)
        model = dataclasses.replace(self.model_config, eos_token_ids=())
        return repr((model, compiled_fields(self.config), self._processors_fingerprint,
                     self.config.returns_distributions, self.config.max_num_samples, shape))

    def _compile(self, shape: tuple[int, int, int], args: tuple) -> jax.stages.Compiled:
        return self.executable_cache.compile(self.step_fn, args, self._description(shape), self._devices)

    def _abstract_args(self, shape: tuple[int, int, int]) -> tuple:
        empty = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        return jax.tree.map(_abstract, self._args(self.prepare(empty, shape), shape))  # (placed: not compiled)

    def cached_prefix(self, shapes: tuple[tuple[int, int, int], ...]) -> int:
        """How many of `shapes`, from the first, the executable cache holds (a restart loads them in
        moments); 0 without a cache, or with a draft model (whose steps compile beside them)."""
        if self.executable_cache.directory is None or self.draft is not None:
            return 0
        return next((i for i, shape in enumerate(shapes) if not self.executable_cache.path(
            self._abstract_args(shape), self._description(shape), self._devices).is_file()), len(shapes))

    @property
    def _devices(self) -> list:
        return list(self.kv_sharding.mesh.devices.flat)

    def compile(self, shape: tuple[int, int, int]) -> None:
        """Compile (or load) the step for `shape`, unless it is; steps may use it from then on
        (`shape`). Any thread may call it while steps run: it reads the cache's and the weights'
        shapes and shardings only."""
        if shape in self.executables:
            return
        args = self._abstract_args(shape)
        if self.draft is not None:
            self.draft.compile_mirror(shape, args)
        self.executables[shape] = self._compile(shape, args)

    def _command(self, command: int, shape: tuple[int, int, int] = (0, 0, 0)) -> None:
        broadcast_plan(np.array([command, *shape], np.int32))
        self._last_broadcast = time.monotonic()

    @property
    def can_step(self) -> bool:
        """Whether the KV cache is still sound: a step that failed after taking it (donated) loses it,
        and one that failed on the device leaves it holding the error."""
        try:
            jax.block_until_ready(self.kv)
        except Exception:
            return False
        return True

    def release_kv(self) -> None:
        """Free the KV cache (sleep): what steps read of it stays, for compiling, until `allocate_kv`."""
        kv, self.kv = self.kv, jax.tree.map(_abstract, self.kv)
        for pages in jax.tree.leaves(kv):
            pages.delete()

    def allocate_kv(self) -> None:
        self.kv = allocate_kv_cache(self.model_config, self.config, self.kv_sharding)

    def release_weights(self) -> None:
        """Drop the weights (sleep): freed unless a trainer that handed them over still holds them."""
        self.weights = [_abstract(w) for w in self.weights]

    def keepalive(self) -> None:
        """Called by an idle process 0: tell the followers it is alive once in a while (a collective
        that waits for hours could time out)."""
        if self._leads and time.monotonic() - self._last_broadcast > KEEPALIVE_S:
            self._command(KEEPALIVE)

    def stop_followers(self) -> None:
        """Process 0, shutting down: the other processes leave `follow`."""
        if self._leads:
            self._command(STOP)

    def follow(self) -> None:
        """Processes other than 0: run each step process 0 broadcasts, until it broadcasts STOP."""
        empty = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        while True:
            command, *shape = broadcast_plan(np.zeros(4, np.int32)).tolist()
            if command == STOP:
                return
            if command == RUN:
                inputs = jax.tree.map(np.asarray, self.prepare(empty, tuple(shape)))  # (paddings as arrays)
                self._run(tuple(shape), broadcast_plan(inputs))

    @staticmethod
    def wait(launched: LaunchedStep) -> None:
        """Wait until a launched step has computed (its outputs stay on the device)."""
        launched.samples.block_until_ready()

    def collect(self, batch: ScheduledBatch, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step and bring its outputs to the host (the prompt logprobs and the
        whole distributions only when some row asked for them)."""
        asked = any(r.prompt_logprobs for r in batch.rows)
        whole = any(r.sample and needs_distribution(r.params.logprobs) for r in batch.rows)
        hidden = any(r.sampling.hidden_layers for r in batch.rows)
        samples, prompt, distributions, hidden = jax.device_get((
            launched.samples, launched.prompt if asked else None, launched.distributions if whole else None,
            launched.hidden if hidden else None))
        out = SampleOutput.unpacked(samples, min(MAX_LOGPROBS, self.model_config.vocab_size),
                                    len(self.processors.carried))
        rows = batch.num_samples
        return StepOutput(token_ids=out.tokens[:rows], logprobs=out.logprobs[:rows], ranks=out.ranks[:rows],
                          top_ids=out.top_ids[:rows], top_logprobs=out.top_logprobs[:rows],
                          entropies=out.entropies[:rows], prompt=prompt, carried=out.carried[:rows],
                          distributions=None if distributions is None else distributions[:rows],
                          hidden=None if hidden is None else np.asarray(hidden, np.float32))

    def shape(self, batch: ScheduledBatch) -> tuple[int, int, int]:
        """The step's buckets: (tokens, sequences, page-table width), the smallest that fit it; while
        some are still compiling, the smallest compiled one that fits (there is one for a batch
        within `token_budget`)."""
        cfg = self.config
        need = (max(batch.num_tokens, 1), max(batch.num_samples, 1),
                max((len(r.page_ids) for r in batch.rows), default=1))
        tokens = _bucket(need[0], cfg.token_buckets)
        best = (tokens, _bucket(need[1], cfg.seqs_buckets(tokens)), _bucket(need[2], cfg.page_buckets))
        if best in self.executables:
            return best
        return next(b for b in cfg.step_buckets  # (ordered by tokens, then sequences, then width)
                    if b in self.executables and all(have >= n for have, n in zip(b, need)))

    def token_budget(self) -> int:
        """The most tokens a step may take now: those of the largest compiled spanning bucket
        (`EngineConfig.spanning_buckets`), which fits any plan of that many tokens."""
        return max((b[0] for b in self.config.spanning_buckets if b in self.executables), default=0)

    def prepare(self, batch: ScheduledBatch, shape: tuple[int, int, int] | None = None,
                slots: dict[int, int] | None = None) -> StepInputs:
        """The step's inputs as host arrays, padded to the batch's buckets (or to `shape`, see
        `shape`); an input no row uses is a `Padding`. `slots`: adapter id (steering key) -> its LoRA
        (steering) slot, for the rows that run with one (`AdapterSlots.assign`, `SteeringSlots.assign`)."""
        cfg = self.config
        num_tokens, num_rows, width = shape or self.shape(batch)
        token_ids, positions = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
        kv_write_index = np.full(num_tokens, NULL_PAGE * cfg.page_size, np.int32)
        kv_lens = np.zeros(num_rows, np.int32)
        page_table = np.full((num_rows, width), NULL_PAGE, np.int32)
        query_start = np.zeros(num_rows + 1, np.int32)
        logits_indices = np.zeros(num_rows, np.int32)
        pending = np.full(num_tokens, -1, np.int32)
        prompt_rows = np.zeros(num_tokens, np.int32)
        targets = np.full(num_tokens, -1, np.int32)
        asked = start = 0
        for b, row in enumerate(batch.rows):
            n = len(row.token_ids)
            pos = np.arange(row.start_position, row.start_position + n)
            pages = np.asarray(row.page_ids, np.int32)
            token_ids[start:start + n] = row.token_ids
            positions[start:start + n] = pos
            kv_write_index[start:start + n] = pages[pos // cfg.page_size] * cfg.page_size + pos % cfg.page_size
            next_tokens = prompt_targets(row)
            prompt_rows[asked:asked + len(next_tokens)] = np.arange(start, start + len(next_tokens))
            targets[asked:asked + len(next_tokens)] = next_tokens
            asked += len(next_tokens)
            kv_lens[b] = row.start_position + n
            page_table[b, :len(pages)] = pages
            start += n
            pending[start - 1] = row.pending_row
            query_start[b + 1] = start
        query_start[len(batch.rows) + 1:] = start
        # each sample reads the logits after its token: a row's last known one, then each draft
        samples = batch.samples()
        for slot, b, j in samples:
            logits_indices[slot] = query_start[b + 1] - 1 - len(batch.rows[b].draft_token_ids) + j
        model = ModelInputs(token_ids=token_ids, positions=positions, rope=rope_table(self.model_config, positions),
                             kv_write_index=kv_write_index, kv_lens=kv_lens,
                             page_table=page_table, query_start=query_start,
                             num_seqs=np.asarray(len(batch.rows), np.int32), logits_indices=logits_indices,
                             lora=self._lora_rows(batch, slots or {}, num_tokens),
                             steer=self._steer_rows(batch, slots or {}, num_tokens),
                             hidden_slots=self._hidden_slots(batch), num_samples=np.asarray(len(samples), np.int32),
                             read_rows=self._read_rows(batch, [logits_indices[:len(samples)], prompt_rows[:asked]],
                                                       num_tokens))
        rows = [SamplingRow(params=r.params, seed=r.seed,
                            position=r.start_position + len(r.token_ids) - len(r.draft_token_ids) + j,
                            token_ids=r.all_token_ids + r.draft_token_ids[:j] if j else r.all_token_ids,
                            num_prompt_tokens=r.num_prompt_tokens, allowed_mask=r.sampling.allowed_mask,
                            processor_args=r.sampling.processor_args, carried=r.carried)
                for r, j in ((batch.rows[b], j) for _, b, j in samples)]
        sampling = SamplingTensors.from_rows(rows, num_rows, self.model_config.vocab_size, cfg.max_model_len,
                                             self.model_config.eos_token_ids, batch.token_masks, keep_padding=True,
                                             processors=self.processors)
        copies = np.full((num_rows, 2), NULL_PAGE, np.int32)  # at most one copy per row
        copies[:len(batch.page_copies)] = np.reshape(batch.page_copies, (-1, 2))
        return StepInputs(page_copies=copies, pending=pending, model=model, sampling=sampling, prompt_rows=prompt_rows,
                          prompt_targets=targets)

    def _lora_rows(self, batch: ScheduledBatch, slots: dict[int, int], num_tokens: int) -> LoraRows | None:
        """Each token row's LoRA slot (-1: none), as the step takes them; None without adapters."""
        if self.adapters is None:
            return None
        token_slots = np.full(num_tokens, -1, np.int32)
        start = 0
        for row in batch.rows:
            if row.lora is not None:
                token_slots[start:start + len(row.token_ids)] = slots[row.lora.lora_int_id]
            start += len(row.token_ids)
        return LoraRows(**LoraRows.of(token_slots, self.adapters.num_slots))

    def _steer_rows(self, batch: ScheduledBatch, slots: dict, num_tokens: int) -> np.ndarray | None:
        """Each token row's steering slot (num_slots: none; the prompt's positions too unless the
        request leaves them out), as the step takes them; None without steering slots."""
        if self.steering is None:
            return None
        rows = np.full(num_tokens, self.steering.num_slots, np.int32)
        start = 0
        for row in batch.rows:
            steering = row.sampling.steering
            if steering is not None:
                first = 0 if steering.prompt else max(0, row.num_prompt_tokens - row.start_position)
                rows[start + first:start + len(row.token_ids)] = slots[steering.key]
            start += len(row.token_ids)
        return rows

    def _read_rows(self, batch: ScheduledBatch, read: list[np.ndarray], num_tokens: int) -> ReadRows | None:
        """The token rows the step reads of the last layer's output (`read`: the rows sampled, those
        asked about; every row where a row gathers the last layer's states) first, where the kernels
        skip the others (`reads_rows`); else None."""
        if not self.reads_rows:
            return None
        mask = np.zeros(num_tokens, bool)
        mask[np.concatenate(read)] = True
        if self.num_hidden and max(hidden_layer_slots(batch.rows), default=-1) >= self.model_config.num_layers - 1:
            mask[:] = True
        return ReadRows(order=np.argsort(~mask, kind="stable").astype(np.int32), count=np.int32(mask.sum()))

    def _hidden_slots(self, batch: ScheduledBatch) -> np.ndarray | None:
        """Per layer, and the final norm last, its slot among the hidden states the step gathers
        (num_hidden: not gathered); None where the engine gathers none."""
        if not self.num_hidden:
            return None
        out = np.full(self.model_config.num_layers + 1, self.num_hidden, np.int32)
        for layer, slot in hidden_layer_slots(batch.rows).items():
            out[layer] = slot
        return out

    def padding_on_device(self, padding: Padding) -> jax.Array:
        """The device copy of `padding`, placed on first use (keyed by its value: the same contents)."""
        if padding not in self._paddings:
            self._paddings[padding] = place(np.asarray(padding), self.replicated)
        return self._paddings[padding]

    def warmup_followers(self, progress: bool = True) -> None:
        """Process 0 of several: run each bucket in turn with an empty batch (it writes only the
        null page), so that the other processes compile theirs as they follow."""
        empty = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        for shape in tqdm(self.config.warmup_order, desc="compiling step buckets", disable=not progress):
            self._run(shape, self.prepare(empty, shape))
        jax.block_until_ready(self.kv)
