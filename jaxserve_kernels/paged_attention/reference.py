"""The jnp reference of ragged paged attention: the semantics every kernel matches.

Layout
  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim], one pair per
  layer, of `cache_dtype(model dtype)`. Page 0 is the null page: padding tokens write there and padded
  page-table entries point there, always behind a mask.

A step is a ragged batch: sequence b owns the query rows
`query_start[b]:query_start[b+1]` (a prefill chunk or one decode token), whose
keys are the first `kv_lens[b]` positions of its pages, the new tokens
included (they are written with `write_kv` before attention). Query row i of
sequence b sits at position `kv_lens[b] - q_len_b + i` and attends causally.
Rows of `query_start` past `num_seqs` repeat the total, so padding sequences
are empty; padding query rows return zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a fully masked (padding) row gives no NaN


BITS = jnp.uint16  # a cache of this type holds bfloat16 values as raw bits (see `cache_dtype`)


def cache_dtype(dtype, backend: str | None = None):
    """The element type the KV pages are stored in for model dtype `dtype`.

    On CPU a bfloat16 cache is stored as its raw bits (uint16): XLA's CPU backend widens a bfloat16
    scatter to float32 over the whole cache (and back) every layer of every step, while an integer
    scatter updates the pages in place. Elsewhere the cache has the model's dtype."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(BITS) if dtype == jnp.bfloat16 and (backend or jax.default_backend()) == "cpu" else dtype


def to_cache(x, cache: jax.Array):
    """Values -> the cache's element type."""
    if cache.dtype == BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), BITS)
    return x.astype(cache.dtype)


def from_cache(x):
    """Cache elements (a gathered tile, never the whole cache) -> values."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == BITS else x


def write_kv(k_pages, v_pages, k, v, kv_write_index):
    """Write the step's new keys and values into their pages (in place when donated).

    k, v: [T, num_kv_heads, head_dim]; kv_write_index: i32[T] = page * page_size + offset.
    """
    page_size = k_pages.shape[1]
    pages, offsets = kv_write_index // page_size, kv_write_index % page_size
    # (every index is a page of the cache: no bounds checks, which XLA:CPU runs as calls of their own)
    return (k_pages.at[pages, offsets].set(to_cache(k, k_pages), mode="promise_in_bounds"),
            v_pages.at[pages, offsets].set(to_cache(v, v_pages), mode="promise_in_bounds"))


def token_positions(query_start, kv_lens, num_seqs, num_tokens):
    """Per query row: its sequence (i32[T]), its position (i32[T]), and whether it is real (bool[T])."""
    num_rows = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, num_rows - 1)
    q_len = query_start[seq + 1] - query_start[seq]
    pos = kv_lens[seq] - q_len + (t - query_start[seq])
    return seq, pos, t < query_start[num_seqs]


def paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                              sm_scale: float, sliding_window: int | None = None,
                              soft_cap: float | None = None, gathered_tokens: int = 1 << 16):
    """Attention of each query row over its own sequence's paged keys.

    q: [T, num_heads, head_dim]; kv_lens: i32[B]; page_table: i32[B, P];
    query_start: i32[B + 1]; num_seqs: i32[] -> [T, num_heads, head_dim] in q.dtype.
    Grouped-query: query head h reads kv head h // (num_heads // num_kv_heads).
    Scores and softmax are float32. `sliding_window` w keeps keys at positions
    > pos - w; `soft_cap` c maps scores s to c * tanh(s / c).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    pages_per_seq = page_table.shape[1]
    context = pages_per_seq * page_size
    group = num_heads // num_kv_heads
    seq, pos, valid = token_positions(query_start, kv_lens, num_seqs, num_tokens)
    key_pos = jnp.arange(context)

    def attend(row):
        q_t, pages_t, pos_t = row  # [H, D], i32[P], i32[]
        # Products take the cache's dtype and accumulate in float32; converting the gathered pages
        # instead would let XLA hoist the conversion over the whole cache.
        k = from_cache(k_pages[pages_t]).reshape(context, num_kv_heads, head_dim)
        v = from_cache(v_pages[pages_t]).reshape(context, num_kv_heads, head_dim)
        qg = q_t.reshape(num_kv_heads, group, head_dim).astype(k.dtype)
        s = jnp.einsum("kgd,ckd->kgc", qg, k, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_pos <= pos_t
        if sliding_window is not None:
            mask &= key_pos > pos_t - sliding_window
        p = jax.nn.softmax(jnp.where(mask, s, MASKED), axis=-1)
        return jnp.einsum("kgc,ckd->kgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).reshape(
            num_heads, head_dim)

    # Query rows are processed in chunks so that at most ~gathered_tokens keys are gathered at once.
    chunk = max(1, min(num_tokens, gathered_tokens // context))
    out = jax.lax.map(attend, (q, page_table[seq], pos), batch_size=chunk)
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
