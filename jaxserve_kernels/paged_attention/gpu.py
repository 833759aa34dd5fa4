"""Ragged paged attention as a Pallas GPU (Triton) kernel.

One program per (query tile, KV head) (`tiles.py`: a tile is up to `block_q` rows of one
sequence). The program holds the tile's queries of that KV head as one [rows, head_dim] matrix
(row r is token r // group, query head r % group; padded to a power of two of at least 16 rows,
which Triton's products need) and walks its sequence's pages `pages_per_block` at a time, from
the first page its rows can see (the sliding window) to the last: it gathers the block's keys
and values straight from the paged cache by page id, and keeps an online softmax (flash
attention) of the running max, sum and output in float32 registers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxserve_kernels.paged_attention import tiles as T
from jaxserve_kernels.paged_attention.reference import MASKED, from_cache

MIN_ROWS = 16  # Triton's smallest matrix product


def unsupported_on_gpu(head_dim: int, page_size: int) -> str | None:
    """Why the kernel cannot run this shape (Triton loads blocks whose sizes are powers of two), or None."""
    for name, size in (("head_dim", head_dim), ("page_size", page_size)):
        if size & (size - 1):
            return f"{name} {size} is not a power of two"
    return None


def _kernel(seq_ref, pos_ref, kv_lens_ref, page_table_ref,  # i32[N], i32[N], i32[B], i32[B, P]
            q_ref, k_ref, v_ref,  # [R, D]; [num_pages, page_size, KVH, D] each
            o_ref,  # [R, D]
            *, sm_scale: float, sliding_window: int | None, soft_cap: float | None, group: int,
            real_rows: int, pages_per_block: int):
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_kv = pages_per_block * page_size
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    seq, first_pos = seq_ref[tile], pos_ref[tile]
    kv_len = kv_lens_ref[seq]
    end = pl.cdiv(jnp.minimum(first_pos + real_rows // group, kv_len), block_kv)  # past the last key seen
    start = 0 if sliding_window is None else jnp.maximum(first_pos - sliding_window + 1, 0) // block_kv
    row_pos = first_pos + jnp.arange(rows)[:, None] // group
    q = q_ref[...]

    def body(block, carry):
        m_prev, l_prev, acc = carry
        pages = page_table_ref[seq, pl.ds(block * pages_per_block, pages_per_block)]
        k = from_cache(k_ref[pages, :, kv_head, :]).reshape(block_kv, head_dim)
        v = from_cache(v_ref[pages, :, kv_head, :]).reshape(block_kv, head_dim)
        s = plgpu.dot(q.astype(k.dtype), k, trans_b=True) * sm_scale  # float32 [R, block_kv]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = block * block_kv + jnp.arange(block_kv)[None, :]
        mask = (key_pos <= row_pos) & (key_pos < kv_len)
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        s = jnp.where(mask, s, MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        return m_next, alpha * l_prev + jnp.sum(p, axis=1), acc

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(start, end, body, init)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def paged_attention_gpu(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                        sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                        block_q: int | None = None, pages_per_block: int = 4, num_warps: int = 4,
                        num_stages: int = 2, interpret: bool = False):
    """See `reference.paged_attention_reference`. `block_q`: query rows per tile (default: `tiles.tile_rows`
    up to 64 / group); `pages_per_block`: pages per block of keys (a power of two). `interpret` runs
    the kernel in Pallas' interpreter (on any backend), where outputs start as NaN."""
    del num_seqs  # padding sequences have no query rows, so no tiles
    num_tokens, num_heads, head_dim = q.shape
    num_rows, width = page_table.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    tile = block_q or T.tile_rows(num_tokens, num_rows, max_tile=max(1, 64 // group))
    tiles = T.query_tiles(query_start, kv_lens, num_tokens, tile)
    rows = max(MIN_ROWS, pl.next_power_of_2(tile * group))
    q_tiles = T.gather(q, tiles, tile).reshape(-1, tile, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, tile * group, head_dim)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - tile * group), (0, 0)))
    # whole blocks of pages: the table's padding points at the null page (masked)
    page_table = jnp.pad(page_table, ((0, 0), (0, -width % pages_per_block)))

    q_spec = pl.BlockSpec((pl.squeezed, pl.squeezed, rows, head_dim), lambda i, h: (i, h, 0, 0))
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          group=group, real_rows=tile * group, pages_per_block=pages_per_block),
        grid=(q_tiles.shape[0], num_kv_heads),
        in_specs=[whole] * 4 + [q_spec, whole, whole],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxserve_paged_attention",
    )(tiles.seq, tiles.first_pos, kv_lens, page_table, q_tiles, k_pages, v_pages)
    out = out[:, :, :tile * group].reshape(-1, num_kv_heads, tile, group, head_dim).transpose(0, 2, 1, 3, 4)
    return T.scatter(out.reshape(-1, tile, num_heads, head_dim), tiles, num_tokens)
