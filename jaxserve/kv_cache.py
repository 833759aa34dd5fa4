"""The paged KV cache: device page arrays allocated once, and the host-side allocator.

Page 0 is the null page: padding tokens write into it and padded page-table
entries point at it, always behind an attention mask, so it is never handed
out. A sequence's page table is the list of page ids it owns, in order
(`Sequence.page_ids`); this module only hands pages out and takes them back.
"""

from __future__ import annotations

import collections
import math

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import KVCache
from kernels import cache_dtype

NULL_PAGE = 0


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


class PageAllocator:
    """Reference-counted pages 1..num_pages-1, with a cache of full pages by content.

    Sequences of one request share their prompt's pages (`share`); a sequence about
    to write into a shared page first takes a private copy (copy-on-write, planned
    by the scheduler, done by the runner).

    Prefix cache: a full page can be registered under the hash of its tokens and of
    everything before it (`register`). When its last holder lets go it is not wiped
    but kept, least recently used first, until a new page is needed (`take`); until
    then a sequence with the same prefix can pick it up again (`lookup` + `acquire`).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # Popped from the end: low ids first, which keeps tests readable.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld hashed pages, LRU first
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash

    @property
    def num_free(self) -> int:
        """Pages that can be handed out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def is_shared(self, page: int) -> bool:
        return self._refs[page] > 1

    def take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently used cached page
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
        self._refs[page] = 1
        return page

    def grow(self, page_ids: list[int], num_tokens: int) -> bool:
        """Append pages to `page_ids` until it holds `num_tokens`; False (nothing taken) if too few are free."""
        missing = self.pages_for(num_tokens) - len(page_ids)
        if missing > self.num_free:
            return False
        for _ in range(max(missing, 0)):
            page_ids.append(self.take())
        return True

    def share(self, page_ids: list[int]) -> None:
        for page in page_ids:
            self._refs[page] += 1

    def drop(self, page: int) -> None:
        """One holder lets go of `page`; with none left it is free, or cached if it has a hash."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def release(self, page_ids: list[int]) -> None:
        """Let go of every page of `page_ids` and empty it."""
        for page in reversed(page_ids):
            self.drop(page)
        page_ids.clear()

    def register(self, page: int, prefix_hash: bytes) -> None:
        """Remember that `page` (full) holds the tokens whose prefix hash is `prefix_hash`. A page
        that held them before and that nobody holds now is freed: the copy in use is the one kept
        (a sequence that computes its prompt whole, for prompt logprobs, makes such copies)."""
        idle = self._page_of.get(prefix_hash)
        if idle is not None and idle in self._cached and page not in self._hash_of:
            del self._cached[idle], self._page_of[prefix_hash], self._hash_of[idle]
            self._free.append(idle)
        if prefix_hash not in self._page_of and page not in self._hash_of:
            self._page_of[prefix_hash] = page
            self._hash_of[page] = prefix_hash

    def lookup(self, prefix_hash: bytes) -> int | None:
        return self._page_of.get(prefix_hash)

    def acquire(self, page: int) -> None:
        """Hold a cached page (found by `lookup`)."""
        self._cached.pop(page, None)
        self._refs[page] += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page's prefix (vLLM's reset_prefix_cache): they become free pages.
        False, changing nothing, while a sequence holds pages."""
        if any(self._refs):
            return False
        self._free.extend(self._cached)
        self._cached.clear()
        self._page_of.clear()
        self._hash_of.clear()
        return True

    def free_page_ids(self) -> list[int]:
        return self._free + list(self._cached)
