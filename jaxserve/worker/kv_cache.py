"""The paged KV cache: device page arrays allocated once.

Page 0 is the null page: padding tokens write into it and padded page-table entries point at it,
always behind an attention mask, so it is never handed out. A sequence's page table is the list of
page ids it owns, in order (`Sequence.page_ids`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from jaxserve.config.engine import EngineConfig
from jaxserve.models import KVCache
from jaxserve.models.config import ModelConfig
from jaxserve_kernels import cache_dtype


def allocate_kv_cache(model: ModelConfig, engine: EngineConfig, sharding: Sharding | None = None) -> KVCache:
    """Zeroed K and V pages for every layer: [num_pages, page_size, num_kv_heads, head_dim] each,
    created in place on their devices when a sharding is given. Element type: `cache_dtype`."""
    shape = (engine.num_pages, engine.page_size, model.num_kv_heads, model.head_dim)
    dtype = cache_dtype(engine.kv_dtype)
    return KVCache(k=[jnp.zeros(shape, dtype, device=sharding) for _ in range(model.num_layers)],
                   v=[jnp.zeros(shape, dtype, device=sharding) for _ in range(model.num_layers)])


def copy_pages(kv: KVCache, page_copies: jax.Array) -> KVCache:
    """page_copies i32[C, 2]: (src, dst) rows, the real copies first, then padding rows (the null
    page onto itself). Only the real ones are copied, one page at a time in place: copies are rare,
    and a gather-scatter of all C rows costs every step (figures: bench/RESULTS.md)."""
    def copy(i, kv):
        src, dst = page_copies[i, 0], page_copies[i, 1]
        return jax.tree.map(lambda pages: jax.lax.dynamic_update_slice_in_dim(
            pages, jax.lax.dynamic_slice_in_dim(pages, src, 1), dst, axis=0), kv)

    return jax.lax.fori_loop(0, jnp.sum(page_copies[:, 0] != page_copies[:, 1]), copy, kv)


