"""Ragged paged attention: one call for a batch of prefill chunks and decodes.

`paged_attention` dispatches by backend. TPU (Mosaic) and GPU Pallas kernels
plug in here (`_KERNELS`); until they exist every backend runs the jnp
reference, which is also what defines the semantics. `impl=` overrides the
choice (tests use it to compare implementations).
"""

from __future__ import annotations

import jax

from kernels.paged_attention.reference import cache_dtype, paged_attention_reference, write_kv

# backend name -> kernel with the reference's signature
_KERNELS = {"cpu": paged_attention_reference}


def paged_attention(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                    impl: str | None = None):
    """See `reference.paged_attention_reference` for shapes and semantics."""
    kernel = _KERNELS.get(impl or jax.default_backend(), paged_attention_reference)
    return kernel(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


__all__ = ["cache_dtype", "paged_attention", "paged_attention_reference", "write_kv"]
