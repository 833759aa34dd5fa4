"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

One grid step per query tile (`tiles.py`: up to `block_q` rows of one sequence). The tile's
queries arrive in VMEM as [kv heads, block_q * group, head_dim] (row r is token r // group,
query head r % group of that KV head), so each KV head is one matrix product. The step walks
its sequence's pages from the first one its rows can see (the sliding window) to the last,
`pages_per_block` pages at a time: each page is DMA'd whole ([page_size, kv heads, head_dim])
from HBM into a double buffer, the next block's copies start before the current block is
used, and an online softmax (flash attention) keeps the running max, sum and output per row
in VMEM scratch, in float32. Products take the cache's dtype and accumulate in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve_kernels.paged_attention import tiles as T
from jaxserve_kernels.paged_attention.reference import MASKED, from_cache

LANES = 128  # the running max and sum are kept broadcast over one vreg's lanes


def _head(buf, kv_head: int):
    """One KV head's keys (or values) from a block of pages [pages, page_size, kv heads, head_dim]."""
    pages, page_size, _, head_dim = buf.shape
    return from_cache(buf[:, :, kv_head, :]).reshape(pages * page_size, head_dim)


def _attend_head(h: int, q_ref, k, v, mask, m_ref, l_ref, acc_ref, *, sm_scale: float, soft_cap: float | None):
    """One KV head's rows of the tile over one block of keys k and values v: the online softmax's
    running max (m_ref), sum (l_ref) and weighted values (acc_ref) updated in place."""
    q = q_ref[0, h].astype(k.dtype)
    s = jnp.einsum("rd,kd->rk", q, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASKED)
    m_prev, l_prev = m_ref[h], l_ref[h]  # [R, LANES], every lane the same
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m_next[:, :1]), 0.0)
    alpha = jnp.exp(m_prev - m_next)
    m_ref[h] = m_next
    l_ref[h] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jnp.einsum("rk,kd->rd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv


def _kernel(seq_ref, pos_ref, kv_lens_ref, page_table_ref,  # scalar prefetch, in SMEM
            q_ref, k_hbm, v_hbm,  # [1, KVH, R, D] in VMEM; [num_pages, page_size, KVH, D] in HBM
            o_ref,  # [1, KVH, R, D]
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref,  # scratch
            *, sm_scale: float, sliding_window: int | None, soft_cap: float | None, group: int):
    _, num_kv_heads, rows, head_dim = q_ref.shape
    _, pages_per_block, page_size, _, _ = k_buf.shape
    block_kv = pages_per_block * page_size
    width = page_table_ref.shape[1]
    tile = pl.program_id(0)
    seq, first_pos = seq_ref[tile], pos_ref[tile]
    kv_len = kv_lens_ref[seq]
    # Blocks of keys [start, end) hold every key a row of the tile sees. (lax.div, not //: the
    # operands are not negative, and floor division would need the chip's sign op.)
    end = jax.lax.div(jnp.minimum(first_pos + rows // group, kv_len) + block_kv - 1, block_kv)
    start = 0 if sliding_window is None else jax.lax.div(jnp.maximum(first_pos - sliding_window + 1, 0), block_kv)
    start = jnp.minimum(start, end)

    def copies(block, slot):
        out = []
        for j in range(pages_per_block):  # pages past the table's width repeat its last one, masked below
            page = page_table_ref[seq, jnp.minimum(block * pages_per_block + j, width - 1)]
            out.append(pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, j], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, j], sems.at[1, slot]))
        return out

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(start < end)
    def _():
        for c in copies(start, 0):
            c.start()

    row_pos = first_pos + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0), group)

    def body(block, carry):
        slot = jax.lax.rem(block - start, 2)

        @pl.when(block + 1 < end)
        def _():
            for c in copies(block + 1, 1 - slot):
                c.start()

        for c in copies(block, slot):
            c.wait()
        key_pos = block * block_kv + jax.lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        mask = (key_pos <= row_pos) & (key_pos < kv_len)
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        for h in range(num_kv_heads):
            _attend_head(h, q_ref, _head(k_buf.at[slot], h), _head(v_buf.at[slot], h), mask, m_ref, l_ref, acc_ref,
                         sm_scale=sm_scale, soft_cap=soft_cap)
        return carry

    jax.lax.fori_loop(start, end, body, 0)
    l = l_ref[...][:, :, :1]
    o_ref[0] = (acc_ref[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def paged_attention_tpu(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                        sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                        block_q: int | None = None, pages_per_block: int = 8, interpret: bool = False):
    """See `reference.paged_attention_reference`. `block_q`: query rows per tile (default: `tiles.tile_rows`
    up to 128 / group); `pages_per_block`: pages per DMA'd block of keys. `interpret` runs the kernel
    in Pallas' TPU interpreter (on any backend), with unwritten memory poisoned with NaN."""
    del num_seqs  # padding sequences have no query rows, so no tiles
    num_tokens, num_heads, head_dim = q.shape
    num_rows, width = page_table.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    tile = block_q or T.tile_rows(num_tokens, num_rows, max_tile=max(1, 128 // group))
    pages_per_block = min(pages_per_block, width)
    tiles = T.query_tiles(query_start, kv_lens, num_tokens, tile)
    rows = tile * group
    q_tiles = T.gather(q, tiles, tile).reshape(-1, tile, num_kv_heads, group, head_dim)
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(-1, num_kv_heads, rows, head_dim)

    q_spec = pl.BlockSpec((1, num_kv_heads, rows, head_dim), lambda i, *_: (i, 0, 0, 0))
    kv_buffer = pltpu.VMEM((2, pages_per_block, page_size, num_kv_heads, head_dim), k_pages.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          group=group),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(q_tiles.shape[0],),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[kv_buffer, kv_buffer, pltpu.SemaphoreType.DMA((2, 2)),
                            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="jaxserve_paged_attention",
    )(tiles.seq, tiles.first_pos, kv_lens, page_table, q_tiles, k_pages, v_pages)
    out = out.reshape(-1, num_kv_heads, tile, group, head_dim).transpose(0, 2, 1, 3, 4)
    return T.scatter(out.reshape(-1, tile, num_heads, head_dim), tiles, num_tokens)
