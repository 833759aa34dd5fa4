"""Ragged paged attention: one call for a batch of prefill chunks and decodes.

`paged_attention` dispatches by backend. The jnp reference (`reference.py`) defines the semantics;
on CPU the query-tiled XLA implementation (`xla.py`) runs. TPU (Mosaic) and GPU Pallas kernels
plug in here (`_BY_BACKEND`); until they exist those backends run the tiled one too. `impl=`
picks an implementation by name (tests use it to compare them).
"""

from __future__ import annotations

import jax

from kernels.paged_attention.reference import cache_dtype, paged_attention_reference, write_kv
from kernels.paged_attention.xla import paged_attention_tiled

IMPLEMENTATIONS = {"reference": paged_attention_reference, "xla": paged_attention_tiled}
_BY_BACKEND: dict[str, str] = {}  # backend -> implementation name, where it is not "xla"


def paged_attention(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs, *,
                    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
                    impl: str | None = None):
    """See `reference.paged_attention_reference` for shapes and semantics."""
    kernel = IMPLEMENTATIONS[impl or _BY_BACKEND.get(jax.default_backend(), "xla")]
    return kernel(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)


__all__ = ["IMPLEMENTATIONS", "cache_dtype", "paged_attention", "paged_attention_reference", "write_kv"]
