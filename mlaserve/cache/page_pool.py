"""The pool of cache pages: which page belongs to which request, and the prefix cache.

Plain bookkeeping (ids and counts, no tensors): the scheduler owns it on rank 0; the tensors the
pages index live in `cache.model_cache`.

Free pages are handed out most recently released first (a stack; the never-used ones in ascending order after
those): the cache's memory becomes resident page by page as rows are first written (model_cache._zeros), so reusing
a resident page keeps the process's memory at the most pages ever held at once. Handing them out in release order
walked through the whole pool instead (16 x 2048 tokens by default), making every page resident in time.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfPages(RuntimeError):
    pass


class PagePool:
    """Free list of page ids with reference counts, plus the prefix cache.

    A full page's content is named by hash(parent page's hash, its token ids). Released pages that
    carry such a hash are kept (evictable, least recently used first) so a later request with the
    same prefix reuses them; they are evicted only when no truly free page is left.
    """

    def __init__(self, num_pages: int, enable_prefix_caching: bool = False) -> None:
        self.num_pages = num_pages
        self.prefix_caching = enable_prefix_caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: the last one is handed out next
        self.ref = [0] * num_pages
        self._hash_of: dict[int, int] = {}  # page -> content hash
        self._page_of: dict[int, int] = {}  # content hash -> page
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, LRU first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"need {n} pages, {self.num_free} free")
        pages = [self._take() for _ in range(n)]
        for p in pages:
            self.ref[p] = 1
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        return page

    def release(self, pages: list[int]) -> None:
        # Reversed: a request's tail pages are evicted before its (more shareable) head pages.
        for p in reversed(pages):
            if self.ref[p] <= 0:
                raise RuntimeError(f"page {p} released more often than allocated")
            self.ref[p] -= 1
            if self.ref[p] == 0:
                if p in self._hash_of:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    def lookup(self, hashes: list[int]) -> list[int]:
        """Pages holding the longest cached run of these page hashes; each gains a reference."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        for p in pages:
            self._evictable.pop(p, None)
            self.ref[p] += 1
        return pages

    def register(self, page: int, content_hash: int) -> bool:
        """Name a page that just became full; a page already named, or a duplicate, is left alone (False)."""
        if not self.prefix_caching or page in self._hash_of or content_hash in self._page_of:
            return False
        self._hash_of[page] = content_hash
        self._page_of[content_hash] = page
        return True


def page_hashes(token_ids: list[int], page_size: int, num_full: int) -> list[int]:
    """Chained content hashes of the first num_full pages."""
    out, parent = [], 0
    for i in range(num_full):
        parent = hash((parent, tuple(token_ids[i * page_size : (i + 1) * page_size])))
        out.append(parent)
    return out
