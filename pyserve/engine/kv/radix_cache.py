"""A radix tree over token ids whose values are KV slots: shared prefixes.

When a request finishes (or is aborted or retracted), the tokens whose KV
it computed are inserted with their slots, and the tree owns those pages.
A new request takes the longest cached prefix of its prompt, computes only
the rest, and locks the path it uses so eviction leaves it alone. When the
pool runs low, unlocked leaves are evicted least recently used first.
With a sliding pool (window_pages.py), a cached page may have lost its
sliding layers' K/V (`drop_windows`) while keeping its full pages: a hit
is only usable where the tokens before its end still have theirs, which
the KV manager checks.

The tree works in whole pages: every edge holds a multiple of `page_size`
tokens, children are keyed by their first page of tokens, and a match is
cut down to whole pages. With page size 1 this is a plain token radix tree.

Tenants: a request's `cache_salt` picks the tree it matches and inserts
into. Requests without a salt share the unsalted tree; each salt has a tree
of its own, made on its first insert and dropped once eviction has emptied
it. A request under a LoRA adapter has the namespace (adapter load, salt)
instead (Sequence.prefix_namespace), so adapters never share either. Two salts never reach each other's pages, so neither can tell from its
time to first token whether the other sent a prompt.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from pyserve.engine.kv.page_allocator import PageAllocator


class RadixNode:
    __slots__ = ("children", "parent", "key", "slots", "ref", "last_access")

    def __init__(self, parent: "RadixNode | None", key: list[int], slots: torch.Tensor):
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.key = key  # token ids on the edge from parent to here (whole pages)
        self.slots = slots  # their KV slots, one per token
        self.ref = 0  # running sequences whose prefix passes through here
        self.last_access = time.monotonic()


def _common_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        # The root of each salt's tree, None's for requests without a salt;
        # roots hold no tokens and are never evicted themselves.
        self.roots: dict[str | None, RadixNode] = {None: self._new_root()}
        self.total_pages = 0  # pages the trees own

    @staticmethod
    def _new_root() -> RadixNode:
        return RadixNode(None, [], torch.empty(0, dtype=torch.long))

    @property
    def root(self) -> RadixNode:
        """The root of the unsalted tree."""
        return self.roots[None]

    def _child_key(self, ids: list[int], pos: int) -> tuple[int, ...]:
        return tuple(ids[pos : pos + self.page_size])

    def _whole_pages(self, n: int) -> int:
        return n - n % self.page_size

    def match_prefix(self, ids: list[int], salt: str | None = None) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of `ids` in `salt`'s tree (whole
        pages), and its last node. A salt without a tree matches nothing; its
        node is then the unsalted root, which no eviction touches."""
        node, pieces, pos = self.roots.get(salt), [], 0
        if node is None:
            return self.root.slots, self.root
        end = self._whole_pages(len(ids))
        now = time.monotonic()
        while pos < end:
            child = node.children.get(self._child_key(ids, pos))
            if child is None:
                break
            n = self._whole_pages(_common_length(child.key, ids[pos:end]))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.slots)
            pos += n
            node = child
        slots = torch.cat(pieces) if pieces else self.root.slots
        return slots, node

    def cached_length(self, ids: list[int], salt: str | None = None) -> int:
        """How many leading `ids` (whole pages) `salt`'s tree holds, as
        match_prefix would find them, touching nothing."""
        node, pos, end = self.roots.get(salt), 0, self._whole_pages(len(ids))
        while node is not None and pos < end:
            node = node.children.get(self._child_key(ids, pos))
            if node is not None:
                n = self._whole_pages(_common_length(node.key, ids[pos:end]))
                pos += n
                if n < len(node.key):
                    break
        return pos

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node's edge after n tokens (whole pages); returns the new upper node."""
        upper = RadixNode(node.parent, node.key[:n], node.slots[:n])
        upper.ref = node.ref
        upper.children[self._child_key(node.key, n)] = node
        node.parent.children[self._child_key(node.key, 0)] = upper
        node.parent = upper
        node.key = node.key[n:]
        node.slots = node.slots[n:]
        return upper

    def lock(self, node: RadixNode) -> None:
        while node is not None:
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            node.ref -= 1
            node = node.parent

    def insert(self, ids: list[int], slots: torch.Tensor, salt: str | None = None) -> int:
        """Add ids -> slots to `salt`'s tree; len(ids) must be whole pages.
        Returns how many leading ids were already cached: the caller's pages
        for those are duplicates it must free (except where they are the
        very pages the tree holds)."""
        if len(ids) % self.page_size:
            raise ValueError("radix cache inserts whole pages only")
        if not ids:
            return 0
        node, pos = self.roots.get(salt), 0
        if node is None:
            node = self.roots[salt] = self._new_root()
        now = time.monotonic()
        while pos < len(ids):
            key = self._child_key(ids, pos)
            child = node.children.get(key)
            if child is None:
                leaf = RadixNode(node, list(ids[pos:]), slots[pos:].clone())
                node.children[key] = leaf
                self.total_pages += len(leaf.key) // self.page_size
                return pos
            n = self._whole_pages(_common_length(child.key, ids[pos:]))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    def evict(self, needed_pages: int) -> int:
        """Free at least `needed_pages` pages if unlocked leaves allow;
        returns how many were freed."""
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._nodes() if not leaf.children
                and leaf.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            self.allocator.free_slots(leaf.slots)
            pages = len(leaf.key) // self.page_size
            self.total_pages -= pages
            freed += pages
            if parent.parent is not None and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        self._drop_empty_salts()
        return freed

    def drop_windows(self, needed_pages: int, protected: torch.Tensor) -> int:
        """Models with sliding layers (kv/window_pages.py): give back at
        least `needed_pages` sliding pages of cached prefixes if there are
        enough, least recently used nodes first, keeping their full pages
        and those of `protected` (a mask over full pages: the ones running
        sequences and pending hits still read). Returns how many."""
        freed = 0
        for node in sorted(self._nodes(), key=lambda n: n.last_access):
            if freed >= needed_pages:
                break
            pages = self.allocator.pages_of(node.slots)
            freed += self.allocator.drop_window(pages[~protected[pages]])
        return freed

    def _drop_empty_salts(self) -> None:
        """Forget the trees of salts that hold nothing and that no sequence
        has locked, so that salts used once do not pile up."""
        for salt in [s for s, root in self.roots.items() if s is not None and not root.children and root.ref == 0]:
            del self.roots[salt]

    def _nodes(self) -> list[RadixNode]:
        """Every node of every tree but the roots."""
        out, stack = [], [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evictable_pages(self) -> int:
        """Pages held by nodes no running sequence uses."""
        return sum(len(n.key) for n in self._nodes() if n.ref == 0) // self.page_size

    def all_slots(self) -> torch.Tensor:
        """Every slot the trees hold, every salt's (for the integrity check)."""
        pieces = [n.slots for n in self._nodes()]
        return torch.cat(pieces) if pieces else self.root.slots
