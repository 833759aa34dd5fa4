"""The draft model of speculative decoding (`{"model": ..., "num_speculative_tokens": k}`).

A smaller model with the target's vocabulary, run by the same engine. Its KV cache has the target's
pages (the same ids, its own layers and heads), so the target's page tables, copies and prefix cache
serve it unchanged. Two jitted functions:
- `mirror`: after every target step, the same step's tokens through the draft model (same packed
  plan, same page copies), so its cache holds every token the target's does;
- `propose`: for the rows of a planned step that have drafts to check, k greedy steps from each
  row's last token (its K/V written at its position, as are the drafts': the plan holds pages for
  them) -> the drafts, which the target then checks as any drafts. A step that checks them runs
  them through `mirror` again, with the target's tokens.
Greedy drafts put all their mass on one token, so the target's check is exact
(`jaxserve/spec_decode/ngram.py`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.config.fields import compiled_fields
from jaxserve.models import KVCache, ModelInputs, forward
from jaxserve.models.config import ModelConfig
from jaxserve.models.rope import rope_inv_freq
from jaxserve.sample.sampler import argmax
from jaxserve.sched.pages import NULL_PAGE
from jaxserve.worker.executables import ExecutableCache
from jaxserve.worker.kv_cache import allocate_kv_cache, copy_pages
from jaxserve.worker.sharding import kv_sharding, place, replicated
from jaxserve.worker.weights import load_weights


def device_rope_table(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
    """`rope.host_rope_table` computed inside a jitted function (the draft's positions are known
    only on the device)."""
    tables = []
    for rope in cfg.ropes:
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(rope, cfg.head_dim))[None, :]
        tables.append(jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1) * np.float32(rope.attention_factor))
    return jnp.stack(tables)


class DraftModel:
    def __init__(self, model_dir: str | Path, model_config: ModelConfig, config: EngineConfig, target: ModelConfig,
                 mesh, executable_cache: ExecutableCache):
        if model_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({model_config.vocab_size} tokens) "
                             f"is not the target's ({target.vocab_size}): a draft model must share its tokenizer")
        self.model_config = model_config = model_config.for_context(config.max_model_len)
        self.config = config
        self.k = config.speculative.num_speculative_tokens
        graphdef, state = load_weights(model_dir, model_config, config.dtype, mesh)
        self.weights, treedef = jax.tree.flatten(state)
        self.kv_sharding = kv_sharding(mesh, model_config)
        self.replicated = replicated(mesh)
        self.kv = allocate_kv_cache(model_config, config, self.kv_sharding)
        self.executable_cache = executable_cache
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        self.devices = list(mesh.devices.flat)

        def model(weights, kv, inputs):
            inputs = inputs.replace(rope=device_rope_table(model_config, inputs.positions))
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return forward(graphdef, jax.tree.unflatten(treedef, weights), kv, inputs)

        def mirror(weights, kv: KVCache, plan, previous: jax.Array) -> KVCache:
            inputs = plan.unpack()
            tokens = jnp.where(inputs.pending >= 0, previous[jnp.maximum(inputs.pending, 0)], inputs.model.token_ids)
            kv = copy_pages(kv, inputs.page_copies)
            return model(weights, kv, inputs.model.replace(token_ids=tokens))[0]

        def propose(weights, kv: KVCache, tokens: jax.Array, positions: jax.Array, page_table: jax.Array,
                    num_seqs: jax.Array) -> tuple[KVCache, jax.Array]:
            rows = tokens.shape[0]
            live = jnp.arange(rows) < num_seqs
            size = config.page_size

            def one(j, carry):
                kv, tokens, drafts = carry
                at = positions + j
                page = jnp.take_along_axis(page_table, (at // size)[:, None], axis=1, mode="fill",
                                           fill_value=NULL_PAGE)[:, 0]  # (past the table: the null page)
                inputs = ModelInputs(
                    token_ids=tokens, positions=at, rope=jnp.zeros(()), kv_lens=jnp.where(live, at + 1, 0),
                    kv_write_index=jnp.where(live, page * size + at % size, NULL_PAGE * size),
                    page_table=page_table, query_start=jnp.minimum(jnp.arange(rows + 1), num_seqs).astype(jnp.int32),
                    num_seqs=num_seqs, logits_indices=jnp.arange(rows, dtype=jnp.int32))
                kv, logits, _ = model(weights, kv, inputs)
                tokens = argmax(logits).astype(jnp.int32)
                return kv, tokens, drafts.at[:, j].set(tokens)

            kv, _, drafts = jax.lax.fori_loop(0, self.k, one, (kv, tokens, jnp.zeros((rows, self.k), jnp.int32)))
            return kv, drafts

        self._mirror = jax.jit(mirror, donate_argnames=("kv",), out_shardings=self.kv_sharding)
        self._propose = jax.jit(propose, donate_argnames=("kv",), out_shardings=(self.kv_sharding, self.replicated))

    @property
    def propose_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, page-table width) of every compiled `propose`: as many rows as may draft, in the
        token buckets' steps."""
        cap = min(self.config.max_num_seqs, self.config.speculative.disable_by_batch_size)
        rows = sorted({cap, *(b for b in self.config.token_buckets if b < cap)})
        return tuple((b, p) for b in rows for p in self.config.page_buckets)

    def _description(self, what: str, shape: tuple) -> str:
        return repr(("draft", what, dataclasses.replace(self.model_config, eos_token_ids=()),
                     compiled_fields(self.config), self.config.max_num_samples, self.k, shape))

    def compile_mirror(self, shape: tuple[int, int, int], args: tuple) -> None:
        """The mirror of step bucket `shape`, whose target step takes `args` (abstract)."""
        if ("mirror", shape) not in self.executables:
            _, _, plan, previous = args[:4]
            draft_args = (self._abstract(self.weights), self._abstract(self.kv), plan, previous)
            self.executables["mirror", shape] = self.executable_cache.compile(
                self._mirror, draft_args, self._description("mirror", shape), self.devices)

    def compile_proposals(self) -> None:
        for rows, width in self.propose_shapes:
            if ("propose", rows, width) in self.executables:
                continue
            vector = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=self.replicated)
            args = (self._abstract(self.weights), self._abstract(self.kv), vector, vector,
                    jax.ShapeDtypeStruct((rows, width), jnp.int32, sharding=self.replicated),
                    jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated))
            self.executables["propose", rows, width] = self.executable_cache.compile(
                self._propose, args, self._description("propose", (rows, width)), self.devices)

    @staticmethod
    def _abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)

    def mirror(self, shape: tuple[int, int, int], plan, previous: jax.Array) -> None:
        """Run the step's tokens (the target's packed plan for bucket `shape`) through the draft model."""
        self.kv = self.executables["mirror", shape](self.weights, self.kv, plan, previous)

    def propose(self, rows: list[tuple[int, int, list[int]]]) -> list[list[int]]:
        """rows: (last token, its position, the sequence's page table, which holds the drafts'
        positions as far as they are checked: K/V past it goes to the null page) -> k greedy drafts
        for each."""
        count, width = len(rows), max(len(pages) for _, _, pages in rows)
        shape = next(s for s in self.propose_shapes if s[0] >= count and s[1] >= width)
        tokens, positions = np.zeros(shape[0], np.int32), np.zeros(shape[0], np.int32)
        table = np.full(shape, NULL_PAGE, np.int32)
        for b, (token, position, pages) in enumerate(rows):
            tokens[b], positions[b], table[b, :len(pages)] = token, position, pages
        args = place([tokens, positions, table, np.asarray(count, np.int32)], self.replicated)
        self.kv, drafts = self.executables[("propose", *shape)](self.weights, self.kv, *args)
        return np.asarray(drafts)[:count].tolist()
