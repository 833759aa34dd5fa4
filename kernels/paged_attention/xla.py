"""Ragged paged attention in plain XLA, by query tiles: the implementation for backends without a
Pallas kernel (CPU).

The reference gathers a sequence's keys and values once per query row, and multiplies them by that
row alone. Here the query rows of each sequence are cut into tiles of up to `tile` consecutive rows
(a tile never spans two sequences), and each tile gathers its sequence's pages once and multiplies
them by all of its rows: a 128-token prefill chunk gathers its context 128 / tile times instead of
128 times, in products `tile` times larger. Same semantics and signature as the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.paged_attention.reference import MASKED, from_cache, paged_attention_reference

MAX_TILE = 16  # query rows per tile
GATHERED_TOKENS = 1 << 16  # keys gathered at once, over the tiles processed together


def tile_rows(num_tokens: int, num_rows: int) -> int:
    """Rows per tile for a step of `num_tokens` query rows from at most `num_rows` sequences: a power
    of two <= num_tokens / num_rows, so padding rows (at most `tile` per sequence) cost at most the
    step's own size (a decode-only step gets tiles of 1 row, as in the reference)."""
    tile = 1
    while tile * 2 <= min(MAX_TILE, num_tokens // max(num_rows, 1)):
        tile *= 2
    return tile


def paged_attention_tiled(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                          sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None):
    """See `reference.paged_attention_reference`."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows, pages_per_seq = page_table.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    context = pages_per_seq * page_size
    tile = tile_rows(num_tokens, num_rows)
    if tile == 1:  # a decode step: one row per sequence, the reference's own best case
        return paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                                         sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    # each sequence adds at most one partial tile, and every tile holds a row
    num_tiles = min(num_tokens, -(-num_tokens // tile) + num_rows)

    # tile i -> (sequence, first row, real rows); tiles past the last are empty
    q_lens = query_start[1:] - query_start[:-1]  # 0 for padding sequences
    tiles_per_seq = -(-q_lens // tile)
    tiles_end = jnp.cumsum(tiles_per_seq)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, i, side="right"), num_rows - 1).astype(jnp.int32)
    first = query_start[seq] + (i - (tiles_end[seq] - tiles_per_seq[seq])) * tile
    real = jnp.where(i < tiles_end[-1], jnp.clip(query_start[seq + 1] - first, 0, tile), 0)
    first_pos = kv_lens[seq] - q_lens[seq] + (first - query_start[seq])  # position of each tile's first row
    q_padded = jnp.pad(q, ((0, tile), (0, 0), (0, 0)))  # a tile may read past the last row
    key_pos = jnp.arange(context)

    def attend(args):
        first_t, pages_t, pos_t = args  # i32[], i32[P], i32[]
        qt = jax.lax.dynamic_slice_in_dim(q_padded, first_t, tile)  # [tile, H, D]
        k = from_cache(k_pages[pages_t]).reshape(context, num_kv_heads, head_dim)
        v = from_cache(v_pages[pages_t]).reshape(context, num_kv_heads, head_dim)
        qg = qt.reshape(tile, num_kv_heads, group, head_dim).astype(k.dtype)
        s = jnp.einsum("tkgd,ckd->ktgc", qg, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = pos_t + jnp.arange(tile)
        mask = key_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        p = jax.nn.softmax(jnp.where(mask[None, :, None, :], s, MASKED), axis=-1)
        o = jnp.einsum("ktgc,ckd->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.reshape(tile, num_heads, head_dim)

    out = jax.lax.map(attend, (first, page_table[seq], first_pos),
                      batch_size=max(1, min(num_tiles, GATHERED_TOKENS // context)))  # [tiles, tile, H, D]
    # Each real row is written by exactly one tile; rows past a tile's real ones are dropped.
    offsets = jnp.arange(tile)
    rows = jnp.where(offsets[None, :] < real[:, None], first[:, None] + offsets[None, :], num_tokens)
    result = jnp.zeros((num_tokens, num_heads, head_dim), jnp.float32)
    result = result.at[rows.reshape(-1)].set(out.reshape(-1, num_heads, head_dim), mode="drop")
    return result.astype(q.dtype)
