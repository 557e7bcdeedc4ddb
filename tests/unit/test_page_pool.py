"""PagePool bookkeeping on its own: reference counts, the prefix cache (content hashes, reuse, LRU
eviction), and misuse that must raise. Plain ids and counts, no tensors, no model."""

from __future__ import annotations

import pytest

from mlaserve.cache.page_pool import OutOfPages, PagePool, page_hashes


def _pool(n: int = 4, prefix: bool = True) -> PagePool:
    return PagePool(n, enable_prefix_caching=prefix)


def test_allocate_and_release_count_references():
    pool = _pool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    assert [pool.ref[p] for p in range(4)] == [1, 1, 1, 0]
    pool.release(a)
    assert pool.num_free == 4 and pool.ref == [0, 0, 0, 0]


def test_allocate_more_than_free_is_an_error_and_takes_nothing():
    pool = _pool(2)
    pool.allocate(1)
    with pytest.raises(OutOfPages, match="need 2 pages, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.parametrize("hashed", [False, True])
def test_double_free_is_an_error(hashed):
    pool = _pool(2)
    [p] = pool.allocate(1)
    if hashed:
        pool.register(p, 1234)
    pool.release([p])
    with pytest.raises(RuntimeError, match=f"page {p} released more often than allocated"):
        pool.release([p])
    assert pool.ref[p] == 0 and pool.num_free == 2


def test_release_of_a_never_allocated_page_is_an_error():
    with pytest.raises(RuntimeError, match="page 3 released"):
        _pool(4).release([3])


def test_shared_page_stays_taken_until_its_last_reference_goes():
    pool = _pool(3)
    [p] = pool.allocate(1)
    pool.register(p, 7)
    assert pool.lookup([7]) == [p] and pool.ref[p] == 2
    pool.release([p])
    assert pool.ref[p] == 1 and pool.num_free == 2  # still held by the other request
    pool.release([p])
    assert pool.ref[p] == 0 and pool.num_free == 3  # evictable: counted free, still named
    assert pool.lookup([7]) == [p] and pool.ref[p] == 1 and pool.num_free == 2  # revived from the LRU


@pytest.mark.parametrize(
    "registered,asked,expected",
    [
        ({10: 0, 11: 1, 12: 2}, [10, 11, 12], [0, 1, 2]),  # whole run cached
        ({10: 0, 11: 1}, [10, 11, 12], [0, 1]),  # longest cached run
        ({11: 1, 12: 2}, [10, 11, 12], []),  # a run starts at the first page or not at all
        ({10: 0, 12: 2}, [10, 11, 12], [0]),  # stops at the first miss
        ({}, [10], []),
        ({10: 0}, [], []),
    ],
)
def test_lookup_returns_the_longest_cached_run(registered, asked, expected):
    pool = _pool(4)
    pages = pool.allocate(4)
    for h, p in registered.items():
        pool.register(pages[p], h)
    pool.release(pages)
    before = pool.num_free
    assert pool.lookup(asked) == expected
    assert all(pool.ref[p] == 1 for p in expected)
    assert pool.num_free == before - len(expected)


def test_truly_free_pages_go_before_cached_ones():
    pool = _pool(4)
    pages = pool.allocate(2)
    pool.register(pages[0], 100)
    pool.release(pages)  # page 0 cached (evictable), page 1 plain free
    assert pool.allocate(3) == [1, 2, 3]  # free pages first, the released one before the never-used; cached 0 kept
    assert pool.lookup([100]) == [0]


def test_released_pages_are_reused_before_never_used_ones():
    """The pool's memory becomes resident page by page as pages are first written: requests that come one after
    another reuse the same pages (a stack), so the resident pages stay at the most ever held at once."""
    pool = _pool(64, prefix=False)
    seen = set()
    for n in (3, 5, 2, 5, 4, 1) * 4:
        pages = pool.allocate(n)
        seen.update(pages)
        pool.release(pages)
    assert seen == set(range(5))
    held = pool.allocate(3)
    assert held == [0, 1, 2]  # a request's pages in ascending order, as released (its tail released first)
    other = pool.allocate(4)
    pool.release(held)
    assert pool.allocate(2) == [0, 1] and other == [3, 4, 5, 6]


def test_eviction_is_least_recently_used_first_and_forgets_the_hash():
    pool = _pool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    for page, h in zip(a + b, (1, 2, 3, 4)):
        pool.register(page, h)
    pool.release(b)  # released reversed (tail first): LRU order 3, 2
    pool.release(a)  # then 1, 0
    assert pool.num_free == 4
    assert pool.allocate(1) == [3]  # b's tail page: least recently used
    assert pool.lookup([3, 4]) == [2]  # hash 4 (page 3) forgotten; hash 3 (page 2) still there
    pool.release([2])  # page 2 used again: now the most recent
    assert pool.allocate(2) == [1, 0]
    assert pool.allocate(1) == [2]
    assert pool.lookup([1]) == [] and pool.lookup([2]) == [] and pool.lookup([3]) == []


def test_lookup_refreshes_nothing_it_does_not_return():
    pool = _pool(2)
    pages = pool.allocate(2)
    pool.register(pages[0], 1)
    pool.register(pages[1], 2)
    pool.release(pages)  # LRU: 1, 0
    assert pool.lookup([9, 2]) == []  # miss on the first hash: page 1 not taken
    assert pool.allocate(1) == [1]


@pytest.mark.parametrize(
    "case",
    ["caching off", "page already named", "hash already names another page"],
)
def test_register_rules(case):
    pool = _pool(3, prefix=case != "caching off")
    p, q = pool.allocate(2)
    pool.register(p, 5)
    if case == "page already named":
        pool.register(p, 6)  # ignored: a page's content does not change while it is named
        pool.release([p, q])
        assert pool.lookup([6]) == [] and pool.lookup([5]) == [p]
    elif case == "hash already names another page":
        pool.register(q, 5)  # a duplicate page stays unnamed and goes back to the free list
        pool.release([q])
        assert pool.lookup([5]) == [p]
        assert pool.allocate(1) == [q] and pool.allocate(1) == [2]  # q, just freed, before the never-used 2
    else:
        pool.release([p, q])
        assert pool.lookup([5]) == []
        assert pool.allocate(3) == [p, q, 2]  # both plain free (nothing was cached), released ones first


def test_page_hashes_are_chained_on_the_prefix():
    ps = 2
    a = page_hashes([1, 2, 3, 4, 5], ps, 2)
    b = page_hashes([1, 2, 3, 9, 5], ps, 2)
    c = page_hashes([7, 2, 3, 4, 5], ps, 2)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same tokens in page 1, different parent
    assert page_hashes([1, 2, 3, 4], ps, 0) == []
    assert page_hashes([1, 2, 3, 4, 5, 6], ps, 2) == a  # only the first num_full pages count
