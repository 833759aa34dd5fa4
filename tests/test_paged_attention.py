"""Paged attention (the jnp reference, the tiled XLA implementation and the CPU custom call) against
dense float64 numpy attention on contiguous K/V."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import X86_64_V2, X86_64_V3, build_for_other_cpu, needs_cpu_backend

from jaxserve_kernels import paged_attention, write_kv

pytestmark = pytest.mark.usefixtures("ieee_float32")


def dense_attention(q, k, v, positions, sm_scale, sliding_window, soft_cap):
    """float64 attention of one sequence's queries (at `positions`) over its keys 0..len(k)-1."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("thd,chd->htc", q, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    c = np.arange(k.shape[0])[None, :]
    mask = c <= positions[:, None]
    if sliding_window is not None:
        mask &= c > positions[:, None] - sliding_window
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("htc,chd->thd", p, v)


@pytest.mark.parametrize("impl", ["reference", "xla", "cpu"])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (7, None), (None, 5.0), (7, 5.0)])
def test_ragged_batch_matches_dense(num_kv_heads, sliding_window, soft_cap, impl):
    if impl == "cpu":
        needs_cpu_backend()
    rng = np.random.default_rng(0)
    num_heads, head_dim, page_size, num_pages = 4, 8, 4, 40
    # (tokens already cached, new tokens this step): prefill, chunk, decodes, length 1
    seqs = [(0, 9), (5, 6), (13, 1), (0, 1), (22, 1)]
    width, rows = 8, 8
    k_pages = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
    v_pages = rng.normal(size=k_pages.shape).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_pages)))  # pages in random order; 0 is the null page
    page_table = np.zeros((rows, width), np.int32)
    full_k, full_v, qs, write_indices, query_start, kv_lens = [], [], [], [], [0], []
    for b, (cached, new) in enumerate(seqs):
        total = cached + new
        n_pages = -(-total // page_size)
        page_table[b, :n_pages] = [free.pop() for _ in range(n_pages)]
        k = rng.normal(size=(total, num_kv_heads, head_dim)).astype(np.float32)
        v = rng.normal(size=k.shape).astype(np.float32)
        pos = np.arange(total)
        flat = page_table[b, pos // page_size] * page_size + pos % page_size
        k_pages.reshape(-1, num_kv_heads, head_dim)[flat[:cached]] = k[:cached]  # the cached part
        v_pages.reshape(-1, num_kv_heads, head_dim)[flat[:cached]] = v[:cached]
        full_k.append(k), full_v.append(v), write_indices.append(flat[cached:])
        qs.append(rng.normal(size=(new, num_heads, head_dim)).astype(np.float32))
        query_start.append(query_start[-1] + new)
        kv_lens.append(total)
    num_tokens = 24  # padded
    real = query_start[-1]
    pad = num_tokens - real
    q = np.concatenate(qs + [rng.normal(size=(pad, num_heads, head_dim)).astype(np.float32)])
    new_k = np.concatenate([k[c:] for k, (c, _) in zip(full_k, seqs)] + [np.ones((pad, num_kv_heads, head_dim))])
    new_v = np.concatenate([v[c:] for v, (c, _) in zip(full_v, seqs)] + [np.ones((pad, num_kv_heads, head_dim))])
    kv_write_index = np.concatenate(write_indices + [np.zeros(pad, np.int64)]).astype(np.int32)
    query_start = np.array(query_start + [real] * (rows - len(seqs)), np.int32)
    kv_lens = np.array(kv_lens + [0] * (rows - len(seqs)), np.int32)

    k_out, v_out = jax.jit(write_kv)(k_pages, v_pages, new_k.astype(np.float32), new_v.astype(np.float32),
                                     kv_write_index)
    flat_k = np.asarray(k_out).reshape(-1, num_kv_heads, head_dim)
    flat_v = np.asarray(v_out).reshape(-1, num_kv_heads, head_dim)
    for b, (cached, new) in enumerate(seqs):  # every new token landed where it belongs
        rows_b = kv_write_index[query_start[b]:query_start[b + 1]]
        np.testing.assert_array_equal(flat_k[rows_b], full_k[b][cached:])
        np.testing.assert_array_equal(flat_v[rows_b], full_v[b][cached:])
    untouched = np.setdiff1d(np.arange(flat_k.shape[0]), kv_write_index)  # nothing else was written
    np.testing.assert_array_equal(flat_k[untouched], k_pages.reshape(flat_k.shape)[untouched])
    np.testing.assert_array_equal(flat_v[untouched], v_pages.reshape(flat_v.shape)[untouched])
    out = jax.jit(paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl"))(
        q, k_out, v_out, kv_lens, page_table, query_start, np.asarray(len(seqs), np.int32),
        sm_scale=head_dim**-0.5, sliding_window=sliding_window, soft_cap=soft_cap, impl=impl)
    out = np.asarray(out)
    for b, (cached, new) in enumerate(seqs):
        want = dense_attention(qs[b].astype(np.float64), full_k[b].astype(np.float64),
                               full_v[b].astype(np.float64), np.arange(cached, cached + new),
                               head_dim**-0.5, sliding_window, soft_cap)
        np.testing.assert_allclose(out[query_start[b]:query_start[b + 1]], want, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out[real:], 0.0)  # padding rows


@pytest.mark.parametrize("impl", ["xla", "cpu"])
@pytest.mark.parametrize("dtype,kv_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                            ("float32", "bfloat16")])
@pytest.mark.parametrize("head_dim,seqs", [
    (16, [(3, 37), (20, 1), (0, 17), (40, 5)]),  # (cached, new): 64 tokens, partial tiles, a decode
    (76, [(40, 1)]),  # one decoding sequence, a head dimension past its last whole vector (8 or 16 lanes)
])
def test_matches_reference_on_wide_tiles(dtype, kv_dtype, impl, head_dim, seqs):
    """Tiles of 16 rows, a random cache; in bfloat16 the cache holds its bits (as the engine stores
    it on CPU), also under a float32 q (`kv_cache_dtype`)."""
    if impl == "cpu":
        needs_cpu_backend()
    from jaxserve_kernels import cache_dtype
    from jaxserve_kernels.paged_attention.reference import to_cache

    rng = np.random.default_rng(1)
    num_heads, num_kv_heads, page_size, num_pages, width = 8, 2, 8, 64, 8
    page_table = np.zeros((len(seqs), width), np.int32)
    pages = rng.permutation(np.arange(1, num_pages))
    for b, (cached, new) in enumerate(seqs):
        n = -(-(cached + new) // page_size)
        page_table[b, :n], pages = pages[:n], pages[n:]
    query_start = np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int32)
    kv_lens = np.array([c + n for c, n in seqs], np.int32)
    q = rng.normal(size=(64, num_heads, head_dim)).astype(np.float32)  # (rows past the last sequence's: padding)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    store = jax.numpy.zeros((), cache_dtype(kv_dtype))
    k_pages, v_pages = (to_cache(jax.numpy.asarray(rng.normal(size=shape), kv_dtype), store) for _ in range(2))
    args = (jax.numpy.asarray(q, dtype), k_pages, v_pages, kv_lens, page_table, query_start, np.int32(len(seqs)))
    run = jax.jit(paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl"))
    for window in (None, 9):
        want = np.asarray(run(*args, sm_scale=0.25, sliding_window=window, impl="reference"), np.float32)
        got = np.asarray(run(*args, sm_scale=0.25, sliding_window=window, impl=impl), np.float32)
        np.testing.assert_allclose(got, want, atol=1e-5 if kv_dtype == "float32" else 2e-2, rtol=0)
        assert np.abs(want[:query_start[-1]]).max() > 0.1 and np.all(want[query_start[-1]:] == 0)


@pytest.mark.parametrize("group,head_dim", [(3, 64), (5, 20), (1, 48), (5, 96)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_blocks_of_query_rows_match_reference(group, head_dim, dtype):
    """Prefill chunks go through the CPU kernel as blocks of up to 16 query rows, a KV head's rows side
    by side in 16-lane vectors: groups whose rows fill the lanes partly (3 x 16 = 48, 5 x 7 = 35), head
    dimensions past the last whole 16, items of 2 to 16 rows, windows and soft caps that cut keys per row.
    In bfloat16 with AVX512-BF16, head dimensions of multiples of 32 take the pair form: 96 = a value
    tile of 64 dimensions and one of 32, 5 x 16 = 80 lanes = value tiles of 6 lanes and one of 2."""
    needs_cpu_backend()
    from test_kernels import ATTENTION, as_float32, ragged_batch

    rows_or_blocks = jax.jit(paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl",
                                                                "row_by_row"))
    rng = np.random.default_rng(group)
    seqs = [(0, 40), (21, 7), (50, 2), (9, 1), (3, 16)]  # (cached, new)
    args = ragged_batch(rng, seqs, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, width=10, rows=6,
                        num_tokens=72)
    real = int(args[5][-1])
    for window, cap in ((None, None), (11, None), (None, 4.0), (5, 4.0)):
        want = np.asarray(ATTENTION(*as_float32(args), sm_scale=0.2, sliding_window=window, soft_cap=cap,
                                    impl="reference"))
        for row_by_row in (False, True):  # (True: every row in the one-row form, as batch-invariant steps ask)
            got = np.asarray(rows_or_blocks(*args, sm_scale=0.2, sliding_window=window, soft_cap=cap, impl="cpu",
                                            row_by_row=row_by_row), np.float32)
            np.testing.assert_allclose(got[:real], want[:real], atol=1e-5 if dtype == "float32" else 2e-2, rtol=0)
            np.testing.assert_array_equal(got[real:], 0.0)
        assert np.abs(want[:real]).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_decode_row_alone_splits_its_keys(dtype):
    """A decode row alone in the call (one stream) takes its keys in two halves on two threads, when it
    sees 512 or more: against the reference, and against the one-row form on one thread (batch-invariant
    steps keep that) within float32 rounding. Halves that end inside a block of 4 keys and inside a
    page, windows that leave more than 512 keys and fewer, soft caps, a padding row after it."""
    needs_cpu_backend()
    from test_kernels import ATTENTION, as_float32, ragged_batch

    rows_or_blocks = jax.jit(paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl",
                                                                "row_by_row"))
    rng = np.random.default_rng(7)
    for cached in (300, 511, 601):
        args = ragged_batch(rng, [(cached, 1)], num_kv_heads=3, group=3, head_dim=64, dtype=dtype, width=80,
                            rows=2, num_tokens=2)
        for window, cap in ((None, None), (550, None), (40, None), (None, 4.0)):
            want = np.asarray(ATTENTION(*as_float32(args), sm_scale=0.125, sliding_window=window, soft_cap=cap,
                                        impl="reference"))
            split, one_row = (np.asarray(rows_or_blocks(*args, sm_scale=0.125, sliding_window=window, soft_cap=cap,
                                                        impl="cpu", row_by_row=row_by_row), np.float32)
                              for row_by_row in (False, True))
            np.testing.assert_allclose(split[:1], want[:1], atol=1e-5 if dtype == "float32" else 2e-2, rtol=0)
            # (bfloat16: a weight rounded either side of a bfloat16 step moves a sum by one such step)
            np.testing.assert_allclose(split[:1], one_row[:1], atol=1e-6 if dtype == "float32" else 1e-2, rtol=0)
            np.testing.assert_array_equal(split[1:], 0.0)
            assert np.abs(want[:1]).max() > 0.1
            if dtype == "float32" and cached == 601 and window is None:  # (the split ran: sums in two parts differ)
                assert (split[:1] != one_row[:1]).any()


@pytest.mark.parametrize("flags,needs", [("-march=x86-64-v2", X86_64_V2), ("-march=x86-64-v3", X86_64_V3)])
def test_cpu_kernel_built_for_other_cpus_matches_reference(flags, needs, monkeypatch, tmp_path):
    """Built with `flags` after -march=native, for a CPU without AVX-512 (x86-64-v3: 8-lane vectors,
    the values of 2 query heads at a time in the one-row form) or without AVX (x86-64-v2), where this
    CPU can run that build: both forms against the reference, groups that fill a pass partly."""
    from test_kernels import ATTENTION, as_float32, ragged_batch

    from jaxserve_kernels.cpu import build
    from jaxserve_kernels.paged_attention import cpu

    build_for_other_cpu(flags, needs, monkeypatch, tmp_path)
    try:
        assert build._register(cpu.SOURCE, "JaxservePagedAttention", target := f"test_{flags}_{cpu.TARGET}")
    finally:
        build._library.cache_clear()
    rng = np.random.default_rng(7)
    for group, head_dim, dtype in [(3, 64, "bfloat16"), (5, 20, "float32"), (1, 76, "bfloat16")]:
        args = ragged_batch(rng, [(0, 40), (21, 7), (50, 1), (9, 1), (3, 16)], num_kv_heads=2, group=group,
                            head_dim=head_dim, dtype=dtype, width=10, rows=6, num_tokens=72)
        real = int(args[5][-1])
        want = np.asarray(ATTENTION(*as_float32(args), sm_scale=0.2, sliding_window=None, soft_cap=None,
                                    impl="reference"))
        for block_rows in (0, cpu.BLOCK_ROWS):  # (0: every row in the one-row form)
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(args[0].shape, args[0].dtype))
            got = np.asarray(call(*args, sm_scale=np.float32(0.2), sliding_window=np.int64(0),
                                  soft_cap=np.float32(0.0), block_rows=np.int64(block_rows)), np.float32)
            np.testing.assert_allclose(got[:real], want[:real], atol=1e-5 if dtype == "float32" else 2e-2, rtol=0)
            np.testing.assert_array_equal(got[real:], 0.0)
