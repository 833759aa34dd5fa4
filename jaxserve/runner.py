"""The device side of a step: pad the plan to a shape bucket, run one jitted call.

`make_step_fn` builds the only jitted entry point: model forward (KV written into the
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
from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from tqdm import tqdm

from jaxserve.config import MAX_LOGPROBS, EngineConfig, ModelConfig
from jaxserve.draft import DraftModel
from jaxserve.executables import ExecutableCache
from jaxserve.kv_cache import NULL_PAGE, allocate_kv_cache, copy_pages
from jaxserve.logits_processors import Processors, fingerprint
from jaxserve.models import KVCache, ModelInputs, forward, head_logits, rope_table
from jaxserve.models.invariant import ROWS, by_rows
from jaxserve.sampling import (Padding, PromptLogprobs, SampleOutput, SamplingRow, SamplingTensors,
                               needs_distribution, prompt_logprobs, sample)
from jaxserve.scheduler import ScheduledBatch, StepOutput, prompt_targets
from jaxserve.settings import compiled_fields
from jaxserve.sharding import broadcast_plan, is_leader, place

# Commands process 0 broadcasts to the other processes: [command, tokens, sequences, page-table width].
RUN, KEEPALIVE, STOP = 0, 1, 2
KEEPALIVE_S = 10.0  # an idle leader still broadcasts this often, so no follower waits in a collective for long
PACKED_MAX_BYTES = 16384  # host inputs up to this size travel to the device together, in one buffer


@flax.struct.dataclass
class StepInputs:
    """One step's inputs, padded to its bucket: T tokens, B sequences (`Runner.shape`). Built on the
    host by `Runner.prepare`, where an input no row uses may be a `Padding`; read by name in the step."""

    page_copies: jax.Array  # i32[B, 2] (src, dst) pages to copy first (`copy_pages`); padding (NULL_PAGE, NULL_PAGE)
    pending: jax.Array  # i32[T] for a token still being sampled, the row of the step before that samples it; else -1
    model: ModelInputs
    sampling: SamplingTensors
    prompt_rows: jax.Array  # i32[T] the tokens, by row, whose next prompt token's logprob a row asks for, first
    prompt_targets: jax.Array  # i32[T] those next prompt tokens (`scheduler.prompt_targets`); -1 past them


class LaunchedStep(NamedTuple):
    """A step's outputs, still on the device until `Runner.collect` fetches them."""

    samples: jax.Array  # i32[B * (4 + 2K + C)] every row's token, logprobs and entropy (`SampleOutput.packed`)
    prompt: PromptLogprobs  # of the prompt tokens asked about (`StepInputs.prompt_rows`), per token of the step
    # f32[B, V] the whole distributions of the rows that ask for more than K top logprobs
    # (`SampleOutput.distributions`); None where max_logprobs allows no more than K
    distributions: jax.Array | None = None


@flax.struct.dataclass
class PackedPlan:
    """A step's inputs as few device arrays: every small input in one buffer of 32-bit words
    (one transfer instead of one per input: each has a fixed host cost), the large ones (the penalty
    history, the grammar masks: usually padding, sent once) on their own. `layout` gives each leaf
    of the `StepInputs` (`treedef`), in order: (shape, dtype, offset into `words`, or -1 for the
    next of `large`). Both depend only on the step's bucket, so they are part of the compiled
    signature (static fields)."""

    words: jax.Array  # i32[n]
    large: tuple[jax.Array, ...]
    layout: tuple[tuple[tuple[int, ...], str, int], ...] = flax.struct.field(pytree_node=False)
    treedef: jax.tree_util.PyTreeDef = flax.struct.field(pytree_node=False)  # StepInputs' structure

    @staticmethod
    def layout_of(leaves: list[np.ndarray | Padding]) -> tuple[tuple[tuple[int, ...], str, int], ...]:
        layout, offset = [], 0
        for leaf in map(np.asarray, leaves):
            if leaf.dtype.itemsize != 4 and leaf.dtype != bool:
                raise TypeError(f"a step input of dtype {leaf.dtype} does not pack into 32-bit words")
            packed = leaf.nbytes <= PACKED_MAX_BYTES
            layout.append((leaf.shape, leaf.dtype.name, offset if packed else -1))
            offset += leaf.size if packed else 0
        return tuple(layout)

    @staticmethod
    def words_of(leaves: list[np.ndarray | Padding], layout) -> np.ndarray:
        """The packed buffer on the host (read-only): 4-byte values bit for bit, booleans as 0 or 1."""
        # (joined as bytes: per leaf, cheaper than viewing, flattening and concatenating arrays)
        return np.frombuffer(b"".join([np.asarray(leaf, np.int32 if dtype == "bool" else None).tobytes()
                                       for leaf, (_, dtype, offset) in zip(leaves, layout) if offset >= 0]), np.int32)

    def unpack(self) -> StepInputs:
        """The step's inputs again (inside the step)."""
        large = iter(self.large)
        leaves = []
        for shape, dtype, offset in self.layout:
            if offset < 0:
                leaves.append(next(large))
                continue
            words = self.words[offset:offset + int(np.prod(shape))].reshape(shape)
            leaves.append(words != 0 if dtype == "bool" else jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
        return jax.tree.unflatten(self.treedef, leaves)


def make_step_fn(graphdef: nnx.GraphDef, state_treedef, kv_sharding: NamedSharding, replicated: NamedSharding,
                 logprobs_mode: str, processors: Processors, distributions: bool = False,
                 batch_invariant: bool = False):
    """The jitted step: (weights, cache, packed `StepInputs`, the step before's tokens) -> (cache, the
    launched step's outputs (`LaunchedStep`: sampled tokens and logprobs of every row, the prompt
    logprobs the inputs ask for), the tokens again padded to max_num_seqs rows: the next step's `previous`).
    A token the inputs mark pending (`pending` >= 0: a row of the step before) is read from
    `previous` on the device, so the next step is launched before this one's tokens reach the host.
    `weights` are the leaves of the model state, whose structure (`graphdef`, `state_treedef`) is
    closed over, so a call hashes no module structure.
    The cache is donated and keeps `kv_sharding`, so the next step sees the same input shardings;
    the samples come out `replicated`, so any process can read them. `logprobs_mode`, `processors`,
    `distributions`: see `sample`. `batch_invariant`: every row computed in fixed-shape tiles
    (`models/invariant.py`): the model and the prompt logprobs by tiles of ROWS tokens, the sampler
    one sequence at a time."""

    chunking = dict(chunk=ROWS, fixed=True) if batch_invariant else {}  # of the prompt logprobs

    def step(weights: list[jax.Array], kv: KVCache, plan: PackedPlan, previous: jax.Array
             ) -> tuple[KVCache, LaunchedStep, jax.Array]:
        inputs = plan.unpack()
        pending, model = inputs.pending, inputs.model
        model = model.replace(token_ids=jnp.where(pending >= 0, previous[jnp.maximum(pending, 0)], model.token_ids))
        # the penalties' history (from the host) lacks a pending token: each row's last input token
        # goes in at its position (for other rows it is there already, or the row uses no penalty)
        last, history = model.logits_indices, inputs.sampling.history
        sampling = inputs.sampling.replace(history=history.at[jnp.arange(last.shape[0]), model.positions[last]].set(
            model.token_ids[last], mode="drop"))
        kv = copy_pages(kv, inputs.page_copies)
        state = jax.tree.unflatten(state_treedef, weights)
        with jax.sharding.use_abstract_mesh(kv_sharding.mesh.abstract_mesh):  # where a Pallas kernel splits
            kv, logits, hidden = forward(graphdef, state, kv, model, batch_invariant)
            prompt = prompt_logprobs(lambda x: head_logits(graphdef, state, x), hidden, inputs.prompt_rows,
                                     inputs.prompt_targets, **chunking)

        def sample_rows(logits, sampling):
            return sample(logits, sampling, logprobs_mode, distributions=distributions, processors=processors)

        if batch_invariant:
            out = by_rows(lambda rows: sample_rows(*rows), (logits, sampling), model.num_seqs, rows=1)
        else:
            out = sample_rows(logits, sampling)
        previous = jnp.pad(out.tokens, (0, previous.shape[0] - out.tokens.shape[0]))
        return kv, LaunchedStep(samples=out.packed(), prompt=prompt, distributions=out.distributions), previous

    return jax.jit(step, donate_argnames=("kv",), out_shardings=(kv_sharding, replicated, replicated))


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    return next(b for b in buckets if b >= n)


def _abstract(x: jax.Array) -> jax.ShapeDtypeStruct:
    """What compiling needs of an argument (an array a step may donate meanwhile still has these)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Runner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, graphdef: nnx.GraphDef, state: nnx.State,
                 kv_sharding: NamedSharding, replicated: NamedSharding, executable_cache: ExecutableCache,
                 processors: Processors, draft: DraftModel | None = None):
        self.model_config = model_config
        self.config = config
        self.graphdef = graphdef
        self.state = state
        self.kv_sharding = kv_sharding
        self.kv = allocate_kv_cache(model_config, config, kv_sharding)
        self.weights, state_treedef = jax.tree.flatten(state)
        self.processors = processors  # the engine's logits processors, traced into the step
        self.draft = draft  # speculative decoding's draft model: each step's tokens go through it too
        # (read once: inspect's source lookup is not safe on the threads that compile)
        self._processors_fingerprint = fingerprint(processors.instances)
        self.step_fn = make_step_fn(graphdef, state_treedef, kv_sharding, replicated, config.logprobs_mode,
                                    processors, config.returns_distributions, config.batch_invariant)
        self.executable_cache = executable_cache
        self.executables: dict[tuple[int, int, int], jax.stages.Compiled] = {}  # step bucket -> step
        self.replicated = replicated  # where host inputs of the step live (every device of the mesh)
        self._paddings: dict[Padding, jax.Array] = {}  # device copies of the inputs no row uses
        self._layouts: dict[tuple[int, int, int], tuple] = {}  # step bucket -> its PackedPlan layout
        self._previous = place(np.zeros(config.max_num_samples, np.int32), replicated)  # the last step's tokens
        self._leads = jax.process_count() > 1 and is_leader()  # process 0 of several: it broadcasts each step
        self._last_broadcast = time.monotonic()

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Dispatch the step; returns at once with the outputs still being computed on the device."""
        shape = self.shape(batch)
        return self._run(shape, self.prepare(batch, shape))

    def _run(self, shape: tuple[int, int, int], inputs: StepInputs) -> LaunchedStep:
        if self._leads:  # the other processes run the same step on the same inputs
            self._command(RUN, shape)
            broadcast_plan(jax.tree.map(np.asarray, inputs))  # (paddings as arrays)
        args = self._args(inputs, shape)
        self.kv, launched, self._previous = self._executable(shape, args)(*args)
        if self.draft is not None:
            self.draft.mirror(shape, *args[2:])
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
        return self.weights, self.kv, plan, self._previous

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
        return self.executable_cache.compile(self.step_fn, args, self._description(shape),
                                             list(self.kv_sharding.mesh.devices.flat))

    def _abstract_args(self, shape: tuple[int, int, int]) -> tuple:
        empty = ScheduledBatch(rows=[], num_tokens=0, preempted=[])
        return jax.tree.map(_abstract, self._args(self.prepare(empty, shape), shape))  # (placed: not compiled)

    def cached_prefix(self, shapes: tuple[tuple[int, int, int], ...]) -> int:
        """How many of `shapes`, from the first, the executable cache holds (a restart loads them in
        moments); 0 without a cache, or with a draft model (whose steps compile beside them)."""
        if self.executable_cache.directory is None or self.draft is not None:
            return 0
        return next((i for i, shape in enumerate(shapes) if not self.executable_cache.path(
            self._abstract_args(shape), self._description(shape)).is_file()), len(shapes))

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

    def collect(self, batch: ScheduledBatch, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step and bring its outputs to the host (the prompt logprobs and the
        whole distributions only when some row asked for them)."""
        asked = any(r.prompt_logprobs for r in batch.rows)
        whole = any(r.sample and needs_distribution(r.params.logprobs) for r in batch.rows)
        samples, prompt, distributions = jax.device_get((launched.samples, launched.prompt if asked else None,
                                                         launched.distributions if whole else None))
        out = SampleOutput.unpacked(samples, min(MAX_LOGPROBS, self.model_config.vocab_size),
                                    len(self.processors.carried))
        rows = batch.num_samples
        return StepOutput(token_ids=out.tokens[:rows], logprobs=out.logprobs[:rows], ranks=out.ranks[:rows],
                          top_ids=out.top_ids[:rows], top_logprobs=out.top_logprobs[:rows],
                          entropies=out.entropies[:rows], prompt=prompt, carried=out.carried[:rows],
                          distributions=None if distributions is None else distributions[:rows])

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

    def prepare(self, batch: ScheduledBatch, shape: tuple[int, int, int] | None = None) -> StepInputs:
        """The step's inputs as host arrays, padded to the batch's buckets (or to `shape`, see
        `shape`); an input no row uses is a `Padding`."""
        cfg = self.config
        num_tokens, num_rows, width = shape or self.shape(batch)
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.zeros(num_tokens, np.int32)
        kv_write_index = np.full(num_tokens, NULL_PAGE * cfg.page_size, np.int32)
        kv_lens = np.zeros(num_rows, np.int32)
        page_table = np.full((num_rows, width), NULL_PAGE, np.int32)
        query_start = np.zeros(num_rows + 1, np.int32)
        logits_indices = np.zeros(num_rows, np.int32)
        pending = np.full(num_tokens, -1, np.int32)
        prompt_rows = np.zeros(num_tokens, np.int32)
        targets = np.full(num_tokens, -1, np.int32)
        asked = 0
        start = 0
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
                             num_seqs=np.asarray(len(batch.rows), np.int32), logits_indices=logits_indices)
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
        for c, (src, dst) in enumerate(batch.page_copies):
            copies[c] = src, dst
        return StepInputs(page_copies=copies, pending=pending, model=model, sampling=sampling, prompt_rows=prompt_rows,
                          prompt_targets=targets)

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
