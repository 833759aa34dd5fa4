"""The paged KV cache: device page arrays allocated once, and the host-side allocator.

Page 0 is the null page: padding tokens write into it and padded page-table
entries point at it, always behind an attention mask, so it is never handed
out. A sequence's page table is the list of page ids it owns, in order
(`Sequence.page_ids`); this module only hands pages out and takes them back.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.sharding import Sharding

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.model import KVCache

NULL_PAGE = 0


def allocate_kv_cache(model: ModelConfig, engine: EngineConfig, sharding: Sharding | None = None) -> KVCache:
    """Zeroed K and V pages for every layer: [num_pages, page_size, num_kv_heads, head_dim] each,
    created in place on their devices when a sharding is given."""
    shape = (engine.num_pages, engine.page_size, model.num_kv_heads, model.head_dim)
    dtype = jnp.dtype(engine.dtype)
    return KVCache(k=[jnp.zeros(shape, dtype, device=sharding) for _ in range(model.num_layers)],
                   v=[jnp.zeros(shape, dtype, device=sharding) for _ in range(model.num_layers)])


class PageAllocator:
    """Reference-counted pages 1..num_pages-1: a page is free when no sequence holds it.

    Sequences of one request share their prompt's pages (`share`); a sequence about
    to write into a shared page first takes a private copy (copy-on-write, planned
    by the scheduler, done by the runner).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # Popped from the end: low ids first, which keeps tests readable.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def is_shared(self, page: int) -> bool:
        return self._refs[page] > 1

    def take(self) -> int:
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def grow(self, page_ids: list[int], num_tokens: int) -> bool:
        """Append pages to `page_ids` until it holds `num_tokens`; False (nothing taken) if too few are free."""
        missing = self.pages_for(num_tokens) - len(page_ids)
        if missing > len(self._free):
            return False
        for _ in range(max(missing, 0)):
            page_ids.append(self.take())
        return True

    def share(self, page_ids: list[int]) -> None:
        for page in page_ids:
            self._refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder lets go of `page`; it is free when none is left."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    def release(self, page_ids: list[int]) -> None:
        """Let go of every page of `page_ids` and empty it."""
        for page in reversed(page_ids):
            self.drop(page)
        page_ids.clear()

    def free_page_ids(self) -> list[int]:
        return list(self._free)
