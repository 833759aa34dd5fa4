"""Ragged paged attention on CPU: a C++ XLA FFI custom call (`cpu.cc`), built on first use.

XLA:CPU runs the jnp formulations poorly: each query tile gathers its sequence's whole context
(up to the page-table width) into a transposed copy, then multiplies it in small batched products
at a few GFLOP/s. The custom call reads each key and value straight from its page, only those a
query row can see, on XLA's own intra-op threads.

`load()` builds it (`jaxserve_kernels/cpu/build.py`: with the system's C++ compiler, once per machine) and
registers the target with XLA. Without a compiler it returns False and the caller keeps the XLA
implementation.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxserve_kernels.cpu import build

TARGET = "jaxserve_paged_attention"
SOURCE = Path(__file__).with_name("cpu.cc")
BLOCK_ROWS = 2  # (measured: 2 rows in the block form as fast as in the one-row form, more rows faster)


def load() -> bool:
    """Build (once per machine) and register the custom call; False where it cannot be built."""
    return build.register(SOURCE, "JaxservePagedAttention", TARGET)


def paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                        sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                        row_by_row: bool = False):
    """See `reference.paged_attention_reference`; `load()` must have returned True. Work items of
    BLOCK_ROWS query rows and more take the kernel's block form, which sums in another order than the
    one-row form; `row_by_row` keeps every row in the one-row form (batch-invariant steps)."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0), block_rows=np.int64(0 if row_by_row else BLOCK_ROWS))
