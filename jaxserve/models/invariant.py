"""Batch-invariant steps (`EngineConfig.batch_invariant`): a row's numbers never depend on the
other rows of its step.

XLA compiles a reduction (a product's sums, a norm's mean, a softmax's normaliser) for the shape
it is given, and the order in which it adds a row's terms may change with the number of rows: on
CPU, XLA multiplies one row as a matrix-vector product and more rows as a matrix product, a norm
over [T, D] reduces one way for small T and another for large T, and the C++ matmul kernels change
form at 16 rows (jaxserve_kernels/matmul/cpu.cc). Within one compiled shape the order is the same for every
row, whatever the other rows hold (tests/test_batch_invariant.py shows both). So in this mode
a step computes everything in tiles of a fixed number of rows (ROWS), each through the same
compiled computation, whatever the step's bucket, its sequences and their chunking:

1. the model, one tile of ROWS tokens after another (`forward_in_tiles`). A tile writes its keys
   and values before its attention reads them, as a prefill chunk does, so a later tile of a
   sequence sees the earlier ones; its attention sees only the tile's own sequences, in a page
   table of ROWS rows (`tile_inputs`) of one width (the widest: `build_engine`), so the attention
   kernels get the same shapes every time too;
2. the LM head, ROWS sequences at a time (`by_rows`), and the sampler one sequence at a time: it
   chooses between code paths per call (e.g. sorting the whole vocabulary when one row's top-p
   reaches past the candidates), and one sequence's settings must not choose another's;
3. prompt logprobs, ROWS tokens at a time through the LM head, each row normalised alone as the
   sampler normalises it (`sampling.prompt_logprobs`, `fixed`).

Only the tiles that hold a real row are computed. A step of T tokens then reads the weights
ceil(T / ROWS) times instead of once: the mode's cost (bench/RESULTS.md, "Batch-invariant mode").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

from jaxserve.models.layers import KVCache, ModelInputs

# Rows per tile: a TPU's bfloat16 register tile (16 x 128) and a GPU tensor-core product's row
# count. On CPU the matmul kernels multiply them in their panel forms; fewer rows (their dot forms)
# make a lone sequence's decode step cheaper and a step of many sequences dearer (bench/RESULTS.md,
# "Batch-invariant mode"). A decode step of one sequence computes ROWS - 1 padding rows.
ROWS = 16
NULL_PAGE = 0  # where padding rows write their keys and values (`ModelInputs.kv_write_index`)

Tree = TypeVar("Tree")


def _pad_rows(x: jax.Array, rows: int, axis: int = 0, mode: str = "constant") -> jax.Array:
    """x with its dimension `axis` padded to a multiple of `rows` (`jnp.pad`'s `mode`: zeros, or
    "edge": copies of the last row)."""
    pad = -x.shape[axis] % rows
    return jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)], mode=mode)


def by_rows(f: Callable[[Tree], Tree], tree: Tree, count: jax.Array, rows: int = ROWS) -> Tree:
    """f applied to `tree` (arrays of N rows along their first dimension) `rows` rows at a time, for
    the tiles holding the first `count` rows (a traced count): f's outputs, rows first, for the N
    rows (zeros past the tiles computed). A last tile of fewer rows is filled with copies of the
    last row, whose outputs are dropped."""
    num = jax.tree.leaves(tree)[0].shape[0]
    padded = jax.tree.map(lambda x: _pad_rows(x, rows, mode="edge"), tree)
    tile = jax.tree.map(lambda x: x[:rows], padded)
    out = jax.tree.map(lambda s: jnp.zeros((num + -num % rows, *s.shape[1:]), s.dtype), jax.eval_shape(f, tile))

    def body(i, out):
        part = f(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * rows, rows), padded))
        return jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, i * rows, 0), out, part)

    out = jax.lax.fori_loop(0, -(-count // rows), body, out)
    return jax.tree.map(lambda x: x[:num], out)


def tile_inputs(inputs: ModelInputs, start: jax.Array, rows: int) -> ModelInputs:
    """The step's inputs for its token rows start .. start + rows - 1 (token arrays padded to a
    multiple of `rows`), as a step of their own: the sequences with rows there, in order, with their
    keys up to the tile's last row; `rows` sequence slots (a tile holds at most that many)."""
    qs, lens, num_seqs = inputs.query_start, inputs.kv_lens, inputs.num_seqs
    num_slots = lens.shape[0]
    end = start + rows
    first = jnp.searchsorted(qs[1:], start, side="right")  # the sequence holding row `start`
    seq = first + jnp.arange(rows)
    held = (seq < num_seqs) & (qs[jnp.minimum(seq, num_slots)] < end)  # sequences with rows in the tile
    s = jnp.minimum(seq, num_slots - 1)
    later = jnp.maximum(qs[s + 1] - end, 0)  # a sequence's rows after the tile: not in its cache yet
    bounds = jnp.clip(qs[jnp.minimum(first + jnp.arange(rows + 1), num_seqs)] - start, 0, rows)

    def rows_of(x: jax.Array, axis: int = 0) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, start, rows, axis)

    return ModelInputs(token_ids=rows_of(inputs.token_ids), positions=rows_of(inputs.positions),
                       rope=rows_of(inputs.rope, 1), kv_write_index=rows_of(inputs.kv_write_index),
                       kv_lens=jnp.where(held, lens[s] - later, 0).astype(jnp.int32),
                       page_table=jnp.where(held[:, None], inputs.page_table[s], NULL_PAGE),
                       query_start=bounds.astype(jnp.int32), num_seqs=jnp.sum(held, dtype=jnp.int32),
                       logits_indices=jnp.zeros(rows, jnp.int32), batch_invariant=True)


def forward_in_tiles(model: Callable[[KVCache, ModelInputs], tuple[KVCache, jax.Array]], kv: KVCache,
                     inputs: ModelInputs, rows: int = ROWS) -> tuple[KVCache, jax.Array]:
    """`model(kv, inputs)` (a `Decoder`: -> (cache, [T, hidden])) one tile of `rows` tokens at a
    time, over the tiles that hold the step's real tokens; the hidden states of the rows past those
    tiles are zeros."""
    num_tokens = inputs.token_ids.shape[0]
    padded = inputs.replace(token_ids=_pad_rows(inputs.token_ids, rows), positions=_pad_rows(inputs.positions, rows),
                            rope=_pad_rows(inputs.rope, rows, 1),
                            kv_write_index=_pad_rows(inputs.kv_write_index, rows))  # (0: the null page)
    start = jnp.zeros((), jnp.int32)
    shape = jax.eval_shape(lambda kv: model(kv, tile_inputs(padded, start, rows))[1], kv)
    hidden = jnp.zeros((padded.token_ids.shape[0], *shape.shape[1:]), shape.dtype)

    def body(i, carry):
        kv, hidden = carry
        kv, h = model(kv, tile_inputs(padded, i * rows, rows))
        return kv, jax.lax.dynamic_update_slice_in_dim(hidden, h, i * rows, 0)

    kv, hidden = jax.lax.fori_loop(0, -(-inputs.query_start[inputs.num_seqs] // rows), body, (kv, hidden))
    return kv, hidden[:num_tokens]
