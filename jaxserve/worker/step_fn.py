"""The one jitted step: its named inputs (`StepInputs`), packed into few device buffers
(`PackedPlan`), and `make_step_fn`, which runs the model, writes the cache and samples."""

from __future__ import annotations

from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxserve.models import forward_residual, head_logits
from jaxserve.models.invariant import ROWS, by_rows
from jaxserve.models.layers import KVCache, ModelInputs
from jaxserve.sample.logits_processors import Processors
from jaxserve.sample.sampler import prompt_logprobs, sample
from jaxserve.sample.tensors import Padding, PromptLogprobs, SamplingTensors
from jaxserve.worker.kv_cache import copy_pages

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


class Staged(NamedTuple):
    """A step ready to launch (`Runner.stage`): its bucket (tokens, sequences, page-table width) and
    host inputs."""

    shape: tuple[int, int, int]
    inputs: StepInputs


class LaunchedStep(NamedTuple):
    """A step's outputs, still on the device until `Runner.collect` fetches them."""

    samples: jax.Array  # i32[B * (4 + 2K + C)] every row's token, logprobs and entropy (`SampleOutput.packed`)
    prompt: PromptLogprobs  # of the prompt tokens asked about (`StepInputs.prompt_rows`), per token of the step
    # f32[B, V] the whole distributions of the rows that ask for more than K top logprobs
    # (`SampleOutput.distributions`); None where max_logprobs allows no more than K
    distributions: jax.Array | None = None
    # [H, T, hidden] the residual stream after the step's asked layers (`ModelInputs.hidden_slots`),
    # at every token, in the activations' dtype (widened on the host, only when asked for); None where
    # the engine gathers none (max_hidden_states_layers 0)
    hidden: jax.Array | None = None


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
                 batch_invariant: bool = False, num_hidden: int = 0):
    """The jitted step: (weights, cache, packed `StepInputs`, the step before's tokens, the LoRA slots'
    stacks or None: `jaxserve.worker.lora`, the steering slots' vectors or None:
    `jaxserve.worker.steering`) -> (cache, the
    launched step's outputs (`LaunchedStep`: sampled tokens and logprobs of every row, the prompt
    logprobs the inputs ask for), the tokens again padded to max_num_seqs rows: the next step's `previous`).
    A token the inputs mark pending (`pending` >= 0: a row of the step before) is read from
    `previous` on the device, so the next step is launched before this one's tokens reach the host.
    `weights` are the leaves of the model state, whose structure (`graphdef`, `state_treedef`) is
    closed over, so a call hashes no module structure.
    The cache is donated and keeps `kv_sharding`, so the next step sees the same input shardings;
    the samples come out `replicated`, so any process can read them. `batch_invariant`: every row
    computed in fixed-shape tiles (`models/invariant.py`): the model and the prompt logprobs by
    tiles of ROWS tokens, the sampler one sequence at a time. `num_hidden`: the layers whose hidden
    states a step gathers (`Decoder.run`)."""

    chunking = dict(chunk=ROWS, fixed=True) if batch_invariant else {}  # of the prompt logprobs

    def step(weights: list[jax.Array], kv: KVCache, plan: PackedPlan, previous: jax.Array, adapters: dict | None,
             steering: jax.Array | None) -> tuple[KVCache, LaunchedStep, jax.Array]:
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
            kv, logits, hidden, gathered = forward_residual(graphdef, state, kv, model, batch_invariant, adapters,
                                                            steering, num_hidden)
            prompt = prompt_logprobs(lambda x: head_logits(graphdef, state, x), hidden, inputs.prompt_rows,
                                     inputs.prompt_targets, **chunking)

        def sample_rows(logits, sampling):
            return sample(logits, sampling, logprobs_mode, distributions=distributions, processors=processors)

        if batch_invariant:
            out = by_rows(lambda rows: sample_rows(*rows), (logits, sampling), model.num_seqs, rows=1)
        else:
            out = sample_rows(logits, sampling)
        previous = jnp.pad(out.tokens, (0, previous.shape[0] - out.tokens.shape[0]))
        launched = LaunchedStep(samples=out.packed(), prompt=prompt, distributions=out.distributions,
                                hidden=gathered)
        return kv, launched, previous

    return jax.jit(step, donate_argnames=("kv",), out_shardings=(kv_sharding, replicated, replicated))
