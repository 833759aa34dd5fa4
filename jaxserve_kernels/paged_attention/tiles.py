"""Query tiles: how the kernels cut a ragged batch of query rows into equal blocks.

A tile is up to `tile` consecutive query rows of ONE sequence (a sequence's rows are cut from
its first row on, so a tile never spans two sequences). The Pallas kernels and the XLA form
compute attention one tile at a time: the tile's rows share their sequence's pages, so those
are read once per tile instead of once per row. `gather` lays the query rows
out tile by tile and `scatter` puts each tile's real rows back; rows of a tile past its real
ones are padding, computed and dropped.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class QueryTiles(NamedTuple):
    seq: jax.Array  # i32[N]: the sequence of each tile
    first: jax.Array  # i32[N]: its first query row
    real: jax.Array  # i32[N]: how many of its rows are real (0 for the tiles past the last)
    first_pos: jax.Array  # i32[N]: the position of its first row in its sequence


def tile_rows(num_tokens: int, num_rows: int, max_tile: int = 16) -> int:
    """Rows per tile for a step of `num_tokens` query rows from at most `num_rows` sequences: a power
    of two <= num_tokens / num_rows (and <= max_tile), so padding rows (at most `tile` per sequence)
    cost at most the step's own size; a decode-only step gets tiles of 1 row."""
    tile = 1
    while tile * 2 <= min(max_tile, num_tokens // max(num_rows, 1)):
        tile *= 2
    return tile


def num_tiles(num_tokens: int, num_rows: int, tile: int) -> int:
    """Enough tiles for any ragged batch: each sequence adds at most one partial tile, and every
    tile holds a row."""
    return min(num_tokens, -(-num_tokens // tile) + num_rows)


def query_tiles(query_start: jax.Array, kv_lens: jax.Array, num_tokens: int, tile: int) -> QueryTiles:
    """The tiles of a step (see `reference.paged_attention_reference` for its arrays)."""
    num_rows = kv_lens.shape[0]
    q_lens = query_start[1:] - query_start[:-1]  # 0 for padding sequences
    tiles_per_seq = -(-q_lens // tile)
    tiles_end = jnp.cumsum(tiles_per_seq)
    i = jnp.arange(num_tiles(num_tokens, num_rows, tile), dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, i, side="right"), num_rows - 1).astype(jnp.int32)
    first = query_start[seq] + (i - (tiles_end[seq] - tiles_per_seq[seq])) * tile
    real = jnp.where(i < tiles_end[-1], jnp.clip(query_start[seq + 1] - first, 0, tile), 0)
    first_pos = kv_lens[seq] - q_lens[seq] + (first - query_start[seq])
    return QueryTiles(seq, first.astype(jnp.int32), real.astype(jnp.int32), first_pos.astype(jnp.int32))


def gather(x: jax.Array, tiles: QueryTiles, tile: int) -> jax.Array:
    """[T, ...] rows -> [N, tile, ...]: each tile's rows (rows past the end read padding)."""
    rows = tiles.first[:, None] + jnp.arange(tile)[None, :]
    return jnp.pad(x, ((0, tile),) + ((0, 0),) * (x.ndim - 1))[rows]


def scatter(out: jax.Array, tiles: QueryTiles, num_tokens: int) -> jax.Array:
    """[N, tile, ...] -> [T, ...]: each real row from the one tile that holds it; rows no tile holds
    (padding rows of the step) are zeros."""
    tile = out.shape[1]
    offsets = jnp.arange(tile)
    rows = jnp.where(offsets[None, :] < tiles.real[:, None], tiles.first[:, None] + offsets[None, :], num_tokens)
    result = jnp.zeros((num_tokens, *out.shape[2:]), out.dtype)
    return result.at[rows.reshape(-1)].set(out.reshape(-1, *out.shape[2:]), mode="drop")
