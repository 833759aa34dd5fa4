"""The host's page pool: free pages, reference counts of shared pages, and the prefix registry
(full pages by the hash of their tokens and all before them)."""

from __future__ import annotations

import collections
import hashlib
import math

import numpy as np

from jaxserve.sched.sequence import Sequence

NULL_PAGE = 0  # never handed out: padding rows and table entries point at it


def page_hash(previous: bytes | None, tokens: list[int]) -> bytes:
    """Prefix-cache key of a full page: sha256 of the previous page's key and its own tokens
    (a collision would serve another prompt's keys and values, so no 64-bit hash)."""
    return hashlib.sha256((previous or b"") + np.asarray(tokens, np.int64).tobytes()).digest()


def salt_seed(cache_salt: str | None, adapter: int | None = None, steering: bytes | None = None) -> bytes | None:
    """What a salted prompt's first page key chains from (`page_hash`'s `previous`): only prompts
    with the same cache_salt, of the same LoRA adapter (its id) and the same steering (its key) share pages."""
    if cache_salt is None and adapter is None and steering is None:
        return None
    key = b"" if cache_salt is None else b"cache_salt\0" + cache_salt.encode()
    key += b"" if adapter is None else b"\0lora\0%d" % adapter
    return hashlib.sha256(key + (b"" if steering is None else b"\0steering\0" + steering)).digest()


def prefix_hashes(token_ids: list[int], page_size: int, seed: bytes | None = None) -> list[bytes]:
    """The prefix-cache keys of the full pages of `token_ids`, first to last."""
    keys, previous = [], seed
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        previous = page_hash(previous, token_ids[start:start + page_size])
        keys.append(previous)
    return keys


class PageAllocator:
    """Reference-counted pages 1..num_pages-1, with a cache of full pages by content.

    Sequences of one request share their prompt's pages (`share`); a sequence about
    to write into a shared page first takes a private copy (copy-on-write, planned
    by the scheduler, done by the runner).

    Prefix cache: a full page can be registered under the hash of its tokens and of
    everything before it (`register`). When its last holder lets go it is not wiped
    but kept, least recently used first, until a new page is needed (`take`); until
    then a sequence with the same prefix can pick it up again (`lookup` + `acquire`).

    With `record_events` it notes what an external router of KV events needs (`events`, taken by
    `take_events`): ("stored", parent key, keys, tokens, its LoRA adapter) for each run of pages one
    sequence registers, ("removed", keys) for each cached page evicted, ("cleared",) when the cache
    is reset.
    """

    def __init__(self, num_pages: int, page_size: int, record_events: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # Popped from the end: low ids first, which keeps tests readable.
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # unheld hashed pages, LRU first
        self._page_of: dict[bytes, int] = {}  # prefix hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> prefix hash
        self.events: list[tuple] | None = [] if record_events else None

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
            evicted = self._hash_of.pop(page)
            del self._page_of[evicted]
            if self.events is not None:
                self.events.append(("removed", [evicted]))
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
        for page in reversed(page_ids):
            self.drop(page)
        page_ids.clear()

    def register(self, page: int, prefix_hash: bytes) -> bool:
        """Remember that `page` (full) holds the tokens whose prefix hash is `prefix_hash`. A page
        that held them before and that nobody holds now is freed: the copy in use is the one kept
        (a sequence that computes its prompt whole, for prompt logprobs, makes such copies).
        -> whether the cache holds those tokens only from now on."""
        known = prefix_hash in self._page_of
        idle = self._page_of.get(prefix_hash)
        if idle is not None and idle in self._cached and page not in self._hash_of:
            del self._cached[idle], self._page_of[prefix_hash], self._hash_of[idle]
            self._free.append(idle)
        if prefix_hash not in self._page_of and page not in self._hash_of:
            self._page_of[prefix_hash] = page
            self._hash_of[page] = prefix_hash
        return not known and self._page_of.get(prefix_hash) == page

    def lookup(self, prefix_hash: bytes) -> int | None:
        return self._page_of.get(prefix_hash)

    def acquire(self, page: int) -> None:
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
        if self.events is not None:
            self.events.append(("cleared",))
        return True

    def take_events(self) -> list[tuple]:
        """The events noted since the last call (`record_events`)."""
        events, self.events = self.events, []
        return events

    def match_prefix(self, seq: Sequence) -> bool:
        """Start a sequence that holds no pages on the cached pages of its longest known prefix
        (full pages only, leaving at least one token to compute). -> whether any matched."""
        if seq.page_ids or not seq.reads_prefix_cache:
            return False
        size = self.page_size
        prefix_hash = seq.hash_seed
        for i in range((seq.num_wanted_tokens - 1) // size):
            prefix_hash = page_hash(prefix_hash, seq.token_ids[i * size:(i + 1) * size])
            page = self.lookup(prefix_hash)
            if page is None:
                break
            self.acquire(page)
            seq.page_ids.append(page)
            seq.page_hashes.append(prefix_hash)
        seq.num_computed_tokens = len(seq.page_ids) * size
        if not seq.num_preemptions:
            seq.num_cached_tokens = seq.num_computed_tokens
        return bool(seq.page_ids)

    def register_full_pages(self, seq: Sequence) -> None:
        size = self.page_size  # (every computed token is known here: see `update`)
        run = None  # the event of the pages stored one after another, so far
        for i in range(len(seq.page_hashes), seq.num_computed_tokens // size):
            parent = seq.page_hashes[-1] if seq.page_hashes else seq.hash_seed
            tokens = seq.token_ids[i * size:(i + 1) * size]
            prefix_hash = page_hash(parent, tokens)
            stored = self.register(seq.page_ids[i], prefix_hash)
            seq.page_hashes.append(prefix_hash)
            if self.events is None or not stored:
                run = None
            elif run is None:
                run = ("stored", parent if seq.page_hashes[:-1] else None, [prefix_hash], list(tokens),
                       seq.lora)
                self.events.append(run)
            else:
                run[2].append(prefix_hash)
                run[3].extend(tokens)

    def allocate(self, seq: Sequence, n: int, page_copies: list[tuple[int, int]]) -> bool:
        """Pages for seq's next n tokens: a private copy of a shared page it writes into, then new pages.
        False (nothing taken) if too few are free."""
        first = seq.num_computed_tokens // self.page_size  # the page the first new token goes into
        copy = first < len(seq.page_ids) and self.is_shared(seq.page_ids[first])
        if self.num_free < max(0, self.pages_for(seq.num_computed_tokens + n) - len(seq.page_ids)) + copy:
            return False
        if copy:
            shared, seq.page_ids[first] = seq.page_ids[first], self.take()
            page_copies.append((shared, seq.page_ids[first]))
            self.drop(shared)
        return self.grow(seq.page_ids, seq.num_computed_tokens + n)

    def free_page_ids(self) -> list[int]:
        return self._free + list(self._cached)
