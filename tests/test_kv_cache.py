"""The paged KV cache: the page allocator on the host (reference counts, the null page, the prefix
cache and its least-recently-used eviction), the device arrays, and the prefix cache through the
offline engine."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CROWDED_ENGINE, SMALL_ENGINE

from checkpoints.default_model import TINY_CONFIG
from jaxserve import LLM, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.models.config import ModelConfig
from jaxserve.sched.pages import NULL_PAGE, PageAllocator
from jaxserve.worker.kv_cache import allocate_kv_cache
from jaxserve_kernels import cache_dtype


def hashes(n: int) -> list[bytes]:
    return [f"prefix-{i}".encode() for i in range(n)]


def test_pages_are_handed_out_once_each_and_never_the_null_page():
    alloc = PageAllocator(num_pages=6, page_size=4)
    assert (alloc.num_usable, alloc.num_free) == (5, 5)
    taken = [alloc.take() for _ in range(5)]
    assert sorted(taken) == [1, 2, 3, 4, 5] and NULL_PAGE not in taken
    assert alloc.num_free == 0 and alloc.free_page_ids() == []
    with pytest.raises(Exception):  # out of pages: neither the null page nor a held one
        alloc.take()


def test_pages_for_rounds_up_to_whole_pages():
    alloc = PageAllocator(num_pages=6, page_size=4)
    assert [alloc.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_grow_takes_the_missing_pages_or_none_when_too_few_are_free():
    alloc = PageAllocator(num_pages=5, page_size=4)  # 4 usable pages
    page_ids: list[int] = []
    assert alloc.grow(page_ids, 5) and len(page_ids) == 2 and alloc.num_free == 2
    held = list(page_ids)
    assert alloc.grow(page_ids, 8) and page_ids == held  # still fits: nothing taken
    assert alloc.grow(page_ids, 3) and page_ids == held  # (fewer tokens: pages are never given back here)
    assert not alloc.grow(page_ids, 17)  # 5 pages: 3 missing, 2 free
    assert page_ids == held and alloc.num_free == 2
    assert alloc.grow(page_ids, 16) and len(page_ids) == 4 and alloc.num_free == 0
    assert len(set(page_ids)) == 4 and NULL_PAGE not in page_ids


def test_released_pages_are_free_again_and_the_list_emptied():
    alloc = PageAllocator(num_pages=5, page_size=4)
    page_ids: list[int] = []
    alloc.grow(page_ids, 12)
    held = set(page_ids)
    alloc.release(page_ids)
    assert page_ids == [] and alloc.num_free == alloc.num_usable
    assert sorted(alloc.free_page_ids()) == [1, 2, 3, 4]
    again: list[int] = []
    alloc.grow(again, 16)
    assert held <= set(again)  # every page, the released ones included, is handed out again


def test_a_shared_page_is_freed_by_its_last_holder_only():
    alloc = PageAllocator(num_pages=5, page_size=4)
    parent: list[int] = []
    alloc.grow(parent, 8)
    child = list(parent)
    alloc.share(child)
    assert all(alloc.is_shared(p) for p in parent) and alloc.num_free == 2
    alloc.release(child)
    assert not any(alloc.is_shared(p) for p in parent) and alloc.num_free == 2  # the parent still holds them
    alloc.drop(parent[1])
    assert alloc.num_free == 3 and parent[1] in alloc.free_page_ids() and parent[0] not in alloc.free_page_ids()
    alloc.drop(parent[0])
    assert alloc.num_free == alloc.num_usable


def test_a_registered_page_is_kept_when_released_and_found_again():
    alloc = PageAllocator(num_pages=5, page_size=4)
    (h,) = hashes(1)
    page = alloc.take()
    alloc.register(page, h)
    assert alloc.lookup(h) == page
    other = alloc.take()  # a second sequence finds the page while the first holds it: they share it
    assert alloc.lookup(h) == page
    alloc.acquire(page)
    assert alloc.is_shared(page) and alloc.num_free == 2
    alloc.drop(page)
    alloc.drop(page)  # its last holder lets go: cached, counted as free, still found
    assert alloc.num_free == 3 and page in alloc.free_page_ids() and alloc.lookup(h) == page
    alloc.acquire(alloc.lookup(h))  # picked up again: held, no longer free
    assert alloc.num_free == 2 and page not in alloc.free_page_ids() and not alloc.is_shared(page)
    alloc.drop(other)  # a page without a hash is simply free
    assert alloc.lookup(h) == page and alloc.num_free == 3


def test_eviction_takes_free_pages_first_then_the_least_recently_used_cached_page():
    alloc = PageAllocator(num_pages=5, page_size=4)  # 4 usable pages
    a, b, c, d = (alloc.take() for _ in range(4))
    ha, hb, hc = hashes(3)
    for page, h in ((a, ha), (b, hb), (c, hc)):
        alloc.register(page, h)
    for page in (a, b, c, d):  # cached in the order a, b, c; d (no hash) free
        alloc.drop(page)
    alloc.acquire(alloc.lookup(ha))  # a is used again: b becomes the least recently used
    alloc.drop(a)
    assert alloc.num_free == 4
    assert alloc.take() == d and [alloc.lookup(h) for h in (ha, hb, hc)] == [a, b, c]  # the free page first
    assert alloc.take() == b and [alloc.lookup(h) for h in (ha, hb, hc)] == [a, None, c]
    assert alloc.take() == c and alloc.lookup(hc) is None
    assert alloc.take() == a and alloc.lookup(ha) is None
    assert alloc.num_free == 0


def test_a_released_sequence_is_evicted_from_its_last_page_back():
    """The pages of one prefix go in reverse: while its first pages stay, a prompt that shares
    only the beginning still finds them."""
    alloc = PageAllocator(num_pages=4, page_size=4)
    page_ids: list[int] = []
    alloc.grow(page_ids, 12)
    for page, h in zip(page_ids, hashes(3)):
        alloc.register(page, h)
    first, second, third = page_ids
    alloc.release(page_ids)
    assert alloc.take() == third and alloc.lookup(hashes(3)[1]) == second
    assert alloc.take() == second and alloc.lookup(hashes(3)[0]) == first
    assert alloc.take() == first


def test_register_keeps_the_copy_in_use_and_one_hash_per_page():
    alloc = PageAllocator(num_pages=6, page_size=4)
    h, h2 = hashes(2)
    idle = alloc.take()
    alloc.register(idle, h)
    alloc.drop(idle)  # cached under h
    copy = alloc.take()  # the same tokens computed again into another page (e.g. for prompt logprobs)
    alloc.register(copy, h)
    assert alloc.lookup(h) == copy  # the copy in use is the one kept; the idle one is plain free now
    assert alloc.num_free == 4 and idle in alloc.free_page_ids()
    third = alloc.take()
    alloc.register(third, h)  # h is held by `copy`: nothing changes
    assert alloc.lookup(h) == copy
    alloc.drop(third)
    assert alloc.lookup(h) == copy and third in alloc.free_page_ids()
    alloc.register(copy, h2)  # a page keeps the hash it has
    assert alloc.lookup(h2) is None and alloc.lookup(h) == copy


def test_reset_prefix_cache_forgets_every_prefix_once_nothing_is_held():
    alloc = PageAllocator(num_pages=5, page_size=4)
    page_ids: list[int] = []
    alloc.grow(page_ids, 12)
    hs = hashes(3)
    for page, h in zip(page_ids, hs):
        alloc.register(page, h)
    held = page_ids.pop()
    alloc.release(page_ids)
    assert not alloc.reset_prefix_cache()  # a page is held: nothing forgotten
    assert [alloc.lookup(h) is not None for h in hs] == [True] * 3
    alloc.drop(held)
    assert alloc.reset_prefix_cache()
    assert [alloc.lookup(h) for h in hs] == [None] * 3
    assert alloc.num_free == alloc.num_usable and sorted(alloc.free_page_ids()) == [1, 2, 3, 4]
    again: list[int] = []
    assert alloc.grow(again, 16) and sorted(again) == [1, 2, 3, 4]


def test_pages_stay_accounted_for_under_random_sequences_sharing_prefixes():
    """Sequences with prompts from a few shared prefixes come and go (prefix lookups, forks,
    releases): a page is held or free, never both; the null page is never handed out; and a
    prefix is only ever found on a page that holds it."""
    rng = np.random.default_rng(0)
    page_size, num_pages = 4, 17
    alloc = PageAllocator(num_pages=num_pages, page_size=page_size)
    prompts = [rng.integers(0, 5, size=int(rng.integers(4, 30))).tolist() for _ in range(6)]
    contents: dict[int, bytes] = {}  # page -> the prefix hash whose tokens it holds
    live: list[tuple[list[int], list[bytes]]] = []  # (page ids, prefix hashes of its full pages)

    def chain(tokens: list[int]) -> list[bytes]:
        out = []
        for i in range(len(tokens) // page_size):
            out.append(json.dumps([out[-1].hex() if out else None, tokens[i * page_size:(i + 1) * page_size]]).encode())
        return out

    for _ in range(400):
        op = rng.integers(0, 3)
        if op == 0 or not live:  # a new sequence: its cached prefix, then fresh pages for the rest
            tokens = prompts[rng.integers(0, len(prompts))]
            full = chain(tokens)
            page_ids: list[int] = []
            for h in full:
                page = alloc.lookup(h)
                if page is None:
                    break
                assert contents[page] == h
                alloc.acquire(page)
                page_ids.append(page)
            reused = len(page_ids)
            if not alloc.grow(page_ids, len(tokens)):
                alloc.release(page_ids)
                continue
            for page in page_ids[reused:]:
                contents.pop(page, None)  # a new page's old contents are overwritten
            for page, h in zip(page_ids[reused:], full[reused:]):
                contents[page] = h
                alloc.register(page, h)
            live.append((page_ids, full))
        elif op == 1:  # a fork shares every page
            page_ids, full = live[rng.integers(0, len(live))]
            alloc.share(page_ids)
            live.append((list(page_ids), full))
        else:
            page_ids, _ = live.pop(rng.integers(0, len(live)))
            alloc.release(page_ids)
        held = {p for page_ids, _ in live for p in page_ids}
        free = alloc.free_page_ids()
        assert NULL_PAGE not in held and NULL_PAGE not in free
        assert len(free) == len(set(free)) == alloc.num_free and not held & set(free)
        assert len(held) + len(free) == alloc.num_usable
        for page_ids, _ in live:
            assert all(alloc.is_shared(p) == (sum(p in ids for ids, _ in live) > 1) for p in page_ids)
    for page_ids, _ in live:
        alloc.release(page_ids)
    assert alloc.num_free == alloc.num_usable and alloc.reset_prefix_cache()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_allocated_cache_is_zeroed_pages_per_layer(dtype, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    model = ModelConfig.from_hf(tmp_path)
    engine = EngineConfig(max_model_len=64, page_size=8, num_pages=5, dtype=dtype)
    kv = allocate_kv_cache(model, engine)
    assert len(kv.k) == len(kv.v) == model.num_layers
    for pages in (*kv.k, *kv.v):
        assert pages.shape == (5, 8, model.num_kv_heads, model.head_dim)
        assert pages.dtype == cache_dtype(dtype) and not jnp.any(pages)


@pytest.fixture(scope="module")
def default_llm():
    return LLM("jaxserve-tiny", **SMALL_ENGINE)  # the built-in jaxserve-tiny (random weights)


def test_prefix_cache_prefills_only_the_new_tokens_and_keeps_the_output(default_llm):
    sched = default_llm.engine.scheduler
    shared = list(range(60, 110))  # 50 tokens: 3 full pages of 16
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = default_llm.generate([shared + [7, 8, 9]], greedy)[0]
    before = sched.num_prompt_tokens_computed
    second = default_llm.generate([shared + [7, 8, 9]], greedy)[0]
    assert second.num_cached_tokens == 48 and sched.num_prompt_tokens_computed - before == 53 - 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    before = sched.num_prompt_tokens_computed
    other = default_llm.generate([shared[:40] + [1, 2, 3, 4, 5]], greedy)[0]  # diverges inside page 3
    assert other.num_cached_tokens == 32 and sched.num_prompt_tokens_computed - before == 45 - 32
    before = sched.num_prompt_tokens_computed
    skipped = default_llm.generate([shared + [7, 8, 9]], dataclasses.replace(greedy, skip_reading_prefix_cache=True))
    assert skipped[0].num_cached_tokens == 0 and sched.num_prompt_tokens_computed - before == 53
    assert skipped[0].outputs[0].token_ids == first.outputs[0].token_ids
    uncached = LLM("jaxserve-tiny", **SMALL_ENGINE, enable_prefix_caching=False)
    assert uncached.generate([shared[:40] + [1, 2, 3, 4, 5]], greedy)[0].outputs[0].token_ids == \
        other.outputs[0].token_ids
    running = default_llm.engine.add_request("running", shared, greedy)
    assert not default_llm.reset_prefix_cache()  # (not while a request runs)
    default_llm.engine.abort(running.request_id)
    assert default_llm.reset_prefix_cache()  # vLLM's: the cached prefixes forgotten
    again = default_llm.generate([shared + [7, 8, 9]], greedy)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_cache_evicts_the_least_recently_used_prefix_through_the_engine():
    """23 usable pages of 16 tokens. Prompts A, B, C and D are 7 full pages and one more token
    (8 pages while they run); each leaves its 7 full pages cached and frees the eighth. A and B
    fill 14 pages; A is read again, so B becomes the least recently used; C takes 8 of the 9
    free pages; D needs 8 with 2 free, so 6 cached pages go: B's, from its last page back. A and
    C are then found whole, and of B only its first page."""
    llm = LLM("jaxserve-tiny", **CROWDED_ENGINE)
    alloc = llm.engine.scheduler.allocator
    assert alloc.num_usable == 23 and alloc.page_size == 16 and llm.reset_prefix_cache()
    rng = np.random.default_rng(0)
    a, b, c, d = (rng.integers(0, 256, size=7 * 16 + 1).tolist() for _ in range(4))
    one = SamplingParams(max_tokens=1, temperature=0.0)

    def cached_tokens(prompt: list[int]) -> int:
        (out,) = llm.generate([prompt], one, use_tqdm=False)
        return out.num_cached_tokens

    assert [cached_tokens(p) for p in (a, b)] == [0, 0]
    assert cached_tokens(a) == 112
    assert [cached_tokens(p) for p in (c, d)] == [0, 0]
    assert alloc.num_free == alloc.num_usable  # (nothing is held between requests)
    assert cached_tokens(a) == 112  # cached first, but read after B
    assert cached_tokens(c) == 112
    assert cached_tokens(b) == 16
