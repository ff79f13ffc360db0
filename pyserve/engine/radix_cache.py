"""A radix tree over token ids whose values are KV slots: shared prefixes.

When a request finishes (or is aborted or retracted), the tokens whose KV
it computed are inserted with their slots, and the tree owns those slots.
A new request takes the longest cached prefix of its prompt, computes only
the rest, and locks the path it uses so eviction leaves it alone. When the
pool runs low, unlocked leaves are evicted least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from pyserve.engine.kv_pool import KVPool


class RadixNode:
    __slots__ = ("children", "parent", "key", "slots", "ref", "last_access")

    def __init__(self, parent: "RadixNode | None", key: list[int], slots: torch.Tensor):
        self.children: dict[int, RadixNode] = {}
        self.parent = parent
        self.key = key  # token ids on the edge from parent to here
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
    def __init__(self, kv_pool: KVPool):
        self.kv_pool = kv_pool
        self.root = RadixNode(None, [], torch.empty(0, dtype=torch.long))
        self.root.ref = 1  # never evicted
        self.total_slots = 0  # slots the tree owns

    def match_prefix(self, ids: list[int]) -> tuple[torch.Tensor, RadixNode]:
        """Slots of the longest cached prefix of `ids`, and its last node."""
        node, pieces, pos = self.root, [], 0
        now = time.monotonic()
        while pos < len(ids) and ids[pos] in node.children:
            child = node.children[ids[pos]]
            n = _common_length(child.key, ids[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pieces.append(child.slots)
            pos += n
            node = child
        slots = torch.cat(pieces) if pieces else self.root.slots
        return slots, node

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node's edge after n tokens; returns the new upper node."""
        upper = RadixNode(node.parent, node.key[:n], node.slots[:n])
        upper.ref = node.ref
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
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

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Add ids -> slots. Returns how many leading ids were already cached:
        the caller's slots for those are duplicates it must free (except
        where they are the very slots the tree holds)."""
        node, pos = self.root, 0
        now = time.monotonic()
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                leaf = RadixNode(node, list(ids[pos:]), slots[pos:].clone())
                node.children[ids[pos]] = leaf
                self.total_slots += len(leaf.key)
                return pos
            n = _common_length(child.key, ids[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    def evict(self, needed: int) -> int:
        """Free at least `needed` slots if unlocked leaves allow; returns
        how many were freed."""
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._leaves() if leaf.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < needed:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.kv_pool.free(leaf.slots)
            self.total_slots -= len(leaf.key)
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def evictable_slots(self) -> int:
        """Slots held by nodes no running sequence uses."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            if node.ref == 0:
                total += len(node.key)
            stack.extend(node.children.values())
        return total
