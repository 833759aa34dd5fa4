"""Ragged paged attention in plain XLA, by query tiles: for backends without a kernel of their own
(CPU without a C++ compiler for `cpu.cc`).

The reference gathers a sequence's keys and values once per query row, and multiplies them by that
row alone. Here the query rows of each sequence are cut into tiles of up to 16 consecutive rows
(`tiles.py`; a tile never spans two sequences), and each tile gathers its sequence's pages once and
multiplies them by all of its rows: a 128-token prefill chunk gathers its context 128 / tile times instead of
128 times, in products `tile` times larger. Same semantics and signature as the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve_kernels.paged_attention import tiles as T
from jaxserve_kernels.paged_attention.reference import MASKED, from_cache, paged_attention_reference

GATHERED_TOKENS = 1 << 16  # keys gathered at once, over the tiles processed together


def paged_attention_tiled(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                          sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None):
    """See `reference.paged_attention_reference`."""
    num_tokens, num_heads, head_dim = q.shape
    num_rows, pages_per_seq = page_table.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    context = pages_per_seq * page_size
    tile = T.tile_rows(num_tokens, num_rows)
    if tile == 1:  # a decode step: one row per sequence, the reference's own best case
        return paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                                         sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    tiles = T.query_tiles(query_start, kv_lens, num_tokens, tile)
    key_pos = jnp.arange(context)

    def attend(args):
        qt, pages_t, pos_t = args  # [tile, H, D], i32[P], i32[]
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

    out = jax.lax.map(attend, (T.gather(q, tiles, tile), page_table[tiles.seq], tiles.first_pos),
                      batch_size=max(1, min(tiles.seq.shape[0], GATHERED_TOKENS // context)))
    return T.scatter(out, tiles, num_tokens).astype(q.dtype)
