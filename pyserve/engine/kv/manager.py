"""The one owner of KV memory: which pages are free, cached or held.

The KV manager owns the page allocator and the radix cache, and is the only
code that sets a sequence's KV fields (`slots`, `shared_len`,
`prefix_node`, `cache_hit`). The scheduler asks it for room and slots and
decides nothing about pages itself; the engine and the API read its figures.

Every page is exactly one of: free, owned by the radix cache (any salt's
tree), or held by one running sequence (its slots past the shared prefix).
`integrity_problem` checks exactly that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.kv.radix_cache import RadixCache, RadixNode
from pyserve.engine.sequence import Sequence

logger = logging.getLogger("pyserve.engine")
_IDLE_CHECK_INTERVAL = 1.0  # seconds


@dataclass
class PrefixHit:
    """A cached prefix found for a waiting sequence, locked until it is
    admitted or given up."""

    slots: torch.Tensor
    node: RadixNode | None

    @property
    def length(self) -> int:
        return self.slots.numel()


class KVManager:
    def __init__(self, allocator: PageAllocator, use_radix_cache: bool = True):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.cache = RadixCache(allocator) if use_radix_cache else None
        self._last_idle_check = -float("inf")

    # -- room and slots ------------------------------------------------------

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """New pages `seq` needs to store `n` more tokens."""
        room = -seq.kv_len % self.page_size  # free slots in its last page
        return max(0, -(-(n - room) // self.page_size))

    def make_room(self, pages: int) -> bool:
        """Evict cached prefixes until `pages` pages are free, if possible."""
        short = pages - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.num_free >= pages

    def new_slots(self, seq: Sequence, n: int) -> torch.Tensor:
        """Slots for `n` more tokens of `seq`: the rest of its last page, then
        new pages. The caller made room first; `append_slots` hands them to
        the sequence once its row is in the step."""
        ps = self.page_size
        if ps == 1:
            return self.allocator.alloc(n)
        room = min(-seq.kv_len % ps, n)
        parts = []
        if room:
            last = int(seq.slots[-1])
            parts.append(torch.arange(last + 1, last + 1 + room))
        pages = self.pages_needed(seq, n)
        if pages:
            fresh = self.allocator.alloc(pages)
            parts.append((fresh[:, None] * ps + torch.arange(ps)).flatten()[: n - room])
        return torch.cat(parts)

    def append_slots(self, seq: Sequence, slots: torch.Tensor) -> None:
        seq.slots = torch.cat([seq.slots, slots])

    def unuse_slots(self, seq: Sequence, slots: torch.Tensor) -> None:
        """Give back slots from `new_slots` that the step will not use after
        all: the pages they opened, if any (slots in `seq`'s last page stay
        free there)."""
        room = -seq.kv_len % self.page_size  # slots that were left in its last page
        if slots.numel() > room:
            self.allocator.free_slots(slots[room:])

    def drop_tail(self, seq: Sequence, keep: int) -> None:
        """Keep `seq`'s first `keep` slots and free the pages past them: the
        KV of draft tokens the target rejected."""
        ps = self.page_size
        first_free_page = -(-keep // ps) * ps
        if first_free_page < seq.kv_len:
            self.allocator.free_slots(seq.slots[first_free_page:])
        seq.slots = seq.slots[:keep]

    # -- prefixes ------------------------------------------------------------

    def can_share(self, seq: Sequence) -> bool:
        """Whether `seq` may start from a cached prefix (one cached under its
        own cache_salt): not when the cache is off, nor when it wants the logits of every prompt position, nor
        when it is an embedding pooled from the first position on."""
        return self.cache is not None and not seq.params.prompt_logprobs and seq.params.pooling in (None, "last")

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of `seq` that `can_share` allows,
        locked. It always leaves the last token to compute: its logits are
        needed."""
        if not self.can_share(seq):
            return PrefixHit(seq.slots[:0], None)
        slots, node = self.cache.match_prefix(seq.all_ids[:-1], seq.prefix_namespace)
        self.cache.lock(node)
        return PrefixHit(slots, node)

    def give_up(self, hit: PrefixHit) -> None:
        """The sequence was not admitted: unlock its prefix."""
        if hit.node is not None:
            self.cache.unlock(hit.node)

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """`seq` starts from `hit`'s slots; the first admission's hit is the
        one reported."""
        seq.slots, seq.shared_len, seq.prefix_node = hit.slots, hit.length, hit.node
        if seq.cache_hit is None:
            seq.cache_hit = hit.length

    def share_prompt(self, seq: Sequence) -> None:
        """Put the prompt computed so far (whole pages) into the cache now,
        not when the request ends, so requests arriving meanwhile with the
        same prefix reuse it. Whoever reads it runs in a later step, after
        this one wrote it. Where the cache already had some of it, the
        sequence switches to the cache's pages and frees its own copies."""
        if self.cache is None:
            return
        known = min(seq.kv_len, len(seq.prompt_ids))
        whole = known - known % self.page_size
        if whole <= seq.shared_len:
            return
        ids = seq.prompt_ids[:whole]
        already = self.cache.insert(ids, seq.slots[:whole], seq.prefix_namespace)
        shared, node = self.cache.match_prefix(ids, seq.prefix_namespace)
        self.cache.lock(node)
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        self.allocator.free_slots(seq.slots[seq.shared_len : max(already, seq.shared_len)])
        seq.slots = torch.cat([shared, seq.slots[whole:]])
        seq.shared_len, seq.prefix_node = whole, node

    def release(self, seq: Sequence) -> None:
        """Everything `seq` holds comes back (it finished, was aborted or is
        retracted). The KV it computed goes into the cache in whole pages (it
        stays valid for any request with the same prefix); pages the cache
        already had, the partial last page, and slots of tokens not known
        yet (pending) are freed."""
        own = seq.slots[seq.shared_len :]
        if self.cache is None or not seq.kv_valid:
            self.allocator.free_slots(own)
        else:
            known = min(seq.kv_len, seq.num_tokens)
            whole = known - known % self.page_size
            already = self.cache.insert(seq.all_ids[:whole], seq.slots[:whole], seq.prefix_namespace)
            self.allocator.free_slots(seq.slots[seq.shared_len : max(already, seq.shared_len)])
            self.allocator.free_slots(seq.slots[whole:])
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        seq.slots = seq.slots[:0]
        seq.shared_len = 0
        seq.prefix_node = None

    def evict_all(self) -> None:
        """Drop every unlocked cached prefix (flush, or after a failed
        forward pass whose KV may be garbage)."""
        if self.cache is not None:
            self.cache.evict(self.cache.total_pages)

    # -- figures -------------------------------------------------------------

    def usage(self, holders: Iterable[Sequence]) -> dict[str, int]:
        """KV cache tokens by owner, in whole pages. When idle, in_use is 0
        and every cached token can be evicted."""
        ps = self.page_size
        owned = sum(-(-(s.kv_len - s.shared_len) // ps) for s in holders)
        cache = self.cache
        return {
            "total": self.allocator.capacity_tokens,
            "free": self.allocator.num_free * ps,
            "in_use": owned * ps,
            "cached": (cache.total_pages if cache is not None else 0) * ps,
            "cached_evictable": (cache.evictable_pages() if cache is not None else 0) * ps,
            "page_size": ps,
        }

    def token_usage(self) -> float:
        """Share of the KV cache that running requests need, as SGLang counts
        it: pages neither free nor evictable (their own pages and the cached
        prefixes they lock). An idle server reads 0 however much it caches."""
        evictable = self.cache.evictable_pages() if self.cache is not None else 0
        return 1.0 - (self.allocator.num_free + evictable) / self.allocator.capacity

    @staticmethod
    def owned_tokens(holders: Iterable[Sequence]) -> int:
        """Tokens running sequences hold outside the cache."""
        return sum(s.kv_len - s.shared_len for s in holders)

    def integrity_problem(self, holders: Iterable[Sequence]) -> str | None:
        """None when every KV page is exactly one of: free, owned by the
        prefix cache, or held by one of `holders` (nothing leaked, nothing
        shared by mistake); else what is wrong. Valid between steps."""
        allocator = self.allocator
        owners = [allocator.free_page_ids()]
        if self.cache is not None:
            owners.append(allocator.pages_of(self.cache.all_slots()))
        owners += [allocator.pages_of(seq.slots[seq.shared_len :]) for seq in holders]
        counts = torch.bincount(torch.cat(owners), minlength=allocator.num_pages)
        counts[0] += 1  # the reserved padding page
        if bool((counts == 1).all()):
            return None
        lost = (counts == 0).nonzero().flatten().tolist()
        doubled = (counts > 1).nonzero().flatten().tolist()
        return f"KV pages leaked: {lost[:10]} (of {len(lost)}); held twice: {doubled[:10]} (of {len(doubled)})"

    def check_when_idle(self) -> None:
        """With nothing running, every page must be free or cached: a leak
        shows here first. At most once a second, so a server answering one
        request at a time does not pay for it on every request."""
        now = time.monotonic()
        if now - self._last_idle_check < _IDLE_CHECK_INTERVAL:
            return
        self._last_idle_check = now
        problem = self.integrity_problem([])
        if problem is not None:
            logger.error("KV cache integrity check failed while idle: %s", problem)
