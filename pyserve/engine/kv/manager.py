"""The one owner of KV memory: which pages are free, cached or held.

The KV manager owns the page allocator and the radix cache, and is the only
code that sets a sequence's KV fields (`slots`, `shared_len`,
`prefix_node`, `cache_hit`). The scheduler asks it for room and slots and
decides nothing about pages itself; the engine and the API read its figures.

Every page is exactly one of: free, owned by the radix cache (any salt's tree), or held by one running
sequence (its slots past the shared prefix). `integrity_problem` checks exactly that.

A model with sliding-window layers has a second, smaller pool for them (window_pages.py): a page keeps its
sliding K/V only while some layer may read it. Before each step a sequence gives back the sliding pages of its
own tokens that its next token no longer sees (`slide`); cached prefixes give theirs back when the sliding pool
runs short, except where a running sequence or a pending hit still reads them; and a prefix hit is cut back to
where the `window - 1` tokens before its end still have theirs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.engine.kv.radix_cache import RadixCache, RadixNode
from pyserve.engine.kv.window_pages import WindowPageAllocator
from pyserve.engine.sequence import Sequence

logger = logging.getLogger("pyserve.engine")
_IDLE_CHECK_INTERVAL = 1.0  # seconds


@dataclass(eq=False)
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
        # The sliding layers' pool, when the model has one: the sequences
        # admitted and not released, and the hits looked up and neither
        # admitted nor given up, whose sliding pages eviction must keep.
        self.windowed = allocator if isinstance(allocator, WindowPageAllocator) else None
        self._holders: set[Sequence] = set()
        self._hits: set[PrefixHit] = set()

    # -- room and slots ------------------------------------------------------

    def pages_needed(self, seq: Sequence, n: int) -> int:
        """New pages `seq` needs to store `n` more tokens."""
        room = -seq.kv_len % self.page_size  # free slots in its last page
        return max(0, -(-(n - room) // self.page_size))

    def make_room(self, pages: int) -> bool:
        """Evict cached prefixes until `pages` pages are free, if possible
        (in both pools: each new page takes a sliding page too)."""
        short = pages - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        if self.allocator.num_free < pages:
            return False
        if self.windowed is None:
            return True
        window_pages = self.windowed.window_pages
        short = pages - window_pages.num_free
        if short > 0 and self.cache is not None:
            self.cache.drop_windows(short, self._window_protected())
        return window_pages.num_free >= pages

    def slide(self, seq: Sequence) -> None:
        """Give back the sliding pages of `seq`'s own tokens that its next
        step no longer reads: the pages wholly below its next token's
        window (position kv_kept - window + 1 on: drafts still being
        verified may be dropped). A step still running reads them before
        any later step can write them again."""
        if self.windowed is None:
            return
        end = self._window_start(seq.kv_kept) // self.page_size * self.page_size
        if end > seq.shared_len:
            self.windowed.drop_window(self.allocator.pages_of(seq.slots[seq.shared_len : end]))

    def _window_start(self, first: int) -> int:
        """The first position the sliding layers read in a step whose
        first new token is at `first`."""
        return max(0, first - self.windowed.window + 1)

    def _window_protected(self) -> torch.Tensor:
        """Per full page, whether a running sequence's next step or a
        pending hit's first chunk reads its sliding K/V from the cache."""
        protected = torch.zeros(self.allocator.num_pages, dtype=torch.bool)
        ps = self.page_size
        reads = [(s.slots, s.kv_kept, s.shared_len) for s in self._holders]
        reads += [(h.slots, h.length, h.length) for h in self._hits]
        for slots, first, cached in reads:
            start = self._window_start(first) // ps * ps
            if start < cached:
                protected[self.allocator.pages_of(slots[start:cached])] = True
        return protected

    def fit_chunk(self, chunk: int | None) -> int | None:
        """The prefill chunk to run with, given --chunked-prefill-size's
        (None: a whole prompt per step). With a sliding pool a step's new
        tokens and the window before them must fit there (with pages for
        rounding and headroom): a larger chunk is lowered to what fits."""
        room = self._step_room()
        if room is None or chunk is None or chunk <= room:
            return chunk
        logger.info("Prefill chunks of %d tokens: what the sliding-window layers' KV pool holds after a window", room)
        return room

    def prompt_capacity(self, chunk: int | None) -> int:
        """The most tokens a prompt may have for the pools to compute it in
        steps of at most `chunk` new tokens (from `fit_chunk`; None: a
        whole prompt per step, which a sliding pool must then hold)."""
        full = self.allocator.capacity_tokens
        room = self._step_room()
        return full if room is None or chunk is not None else min(full, room)

    def _step_room(self) -> int | None:
        """New tokens one step of one prompt may add to the sliding pool
        after its window; None without a sliding pool."""
        if self.windowed is None:
            return None
        window_pool = self.windowed.window_pages.capacity_tokens
        room = window_pool - self.windowed.window - 3 * self.page_size
        if room < 1:
            raise ValueError(f"the sliding-window layers' KV pool holds {window_pool} tokens: too few for a "
                             f"window of {self.windowed.window}; raise --swa-full-tokens-ratio")
        return room

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
        """Whether `seq` may start from a cached prefix (one cached under its own cache_salt): not when the cache
        is off, nor when it wants the logits or hidden states of every prompt position, nor when it is an
        embedding pooled from the first position on, nor when its KV is not for the cache (Sequence.caches_kv)."""
        p = seq.params
        whole = p.prompt_logprobs or p.return_hidden_states or p.pooling not in (None, "last")
        return self.cache is not None and not whole and seq.caches_kv

    def lookup(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of `seq` that `can_share` allows,
        locked. It always leaves the last token to compute: its logits are
        needed."""
        if not self.can_share(seq):
            return PrefixHit(seq.slots[:0], None)
        slots, node = self.cache.match_prefix(seq.all_ids[:-1], seq.prefix_namespace)
        if self.windowed is not None:
            usable = self._usable_length(slots)
            if usable < slots.numel():
                slots, node = self.cache.match_prefix(seq.all_ids[:usable], seq.prefix_namespace)
        self.cache.lock(node)
        hit = PrefixHit(slots, node)
        if self.windowed is not None:
            self._hits.add(hit)
        return hit

    def _usable_length(self, slots: torch.Tensor) -> int:
        """The longest prefix (whole pages) of cached `slots` that a new
        token can continue: the sliding layers of its first new token read
        the `window - 1` tokens before it, which must still have their
        sliding pages; the others are computed again."""
        missing = (~self.windowed.has_window(slots)).nonzero().flatten().tolist()
        if not missing:
            return slots.numel()
        length = slots.numel()
        while length > 0:
            i = bisect.bisect_left(missing, length)  # missing[i - 1]: the last one before `length`
            if i == 0 or missing[i - 1] < self._window_start(length):
                break
            length -= self.page_size
        return length

    def give_up(self, hit: PrefixHit) -> None:
        """The sequence was not admitted: unlock its prefix."""
        self._hits.discard(hit)
        if hit.node is not None:
            self.cache.unlock(hit.node)

    def admit(self, seq: Sequence, hit: PrefixHit) -> None:
        """`seq` starts from `hit`'s slots; the first admission's hit is the
        one reported."""
        seq.slots, seq.shared_len, seq.prefix_node = hit.slots, hit.length, hit.node
        if seq.cache_hit is None:
            seq.cache_hit = hit.length
        if self.windowed is not None:
            self._hits.discard(hit)
            self._holders.add(seq)

    def share_prompt(self, seq: Sequence) -> None:
        """Put the prompt computed so far (whole pages) into the cache now,
        not when the request ends, so requests arriving meanwhile with the
        same prefix reuse it. Whoever reads it runs in a later step, after
        this one wrote it. Where the cache already had some of it, the
        sequence switches to the cache's pages and frees its own copies."""
        if self.cache is None or not seq.caches_kv:
            return
        known = min(seq.kv_len, len(seq.prompt_ids), _draft_kv_end(seq))
        whole = known - known % self.page_size
        if whole <= seq.shared_len:
            return
        ids = seq.prompt_ids[:whole]
        already = self.cache.insert(ids, seq.slots[:whole], seq.prefix_namespace)
        shared, node = self.cache.match_prefix(ids, seq.prefix_namespace)
        self.cache.lock(node)
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        self._free_copies(seq.slots, shared, seq.shared_len, already)
        seq.slots = torch.cat([shared, seq.slots[whole:]])
        seq.shared_len, seq.prefix_node = whole, node

    def release(self, seq: Sequence) -> None:
        """Everything `seq` holds comes back (it finished, was aborted or is
        retracted). The KV it computed goes into the cache in whole pages (it
        stays valid for any request with the same prefix); pages the cache
        already had, the partial last page, and slots of tokens not known
        yet (pending) are freed."""
        own = seq.slots[seq.shared_len :]
        if self.cache is None or not seq.caches_kv:
            self.allocator.free_slots(own)
        else:
            known = min(seq.kv_len, seq.num_tokens, _draft_kv_end(seq))
            whole = known - known % self.page_size
            already = self.cache.insert(seq.all_ids[:whole], seq.slots[:whole], seq.prefix_namespace)
            cached = None
            if self.windowed is not None and already > seq.shared_len:
                cached = self.cache.match_prefix(seq.all_ids[:already], seq.prefix_namespace)[0]
            self._free_copies(seq.slots, cached, seq.shared_len, already)
            self.allocator.free_slots(seq.slots[whole:])
        if seq.prefix_node is not None:
            self.cache.unlock(seq.prefix_node)
        self._holders.discard(seq)
        seq.slots = seq.slots[:0]
        seq.shared_len = 0
        seq.prefix_node = None

    def _free_copies(self, own: torch.Tensor, cached: torch.Tensor | None, start: int, end: int) -> None:
        """Free `own[start:end]`, pages the cache already held as `cached`
        (same positions). Where the cache's page has lost its sliding K/V
        and the copy has it, the cache's page takes it over: a sequence
        switching to the cache's pages may still read it."""
        if end <= start:
            return
        copies = self.allocator.pages_of(own[start:end])
        if self.windowed is not None and cached is not None:
            self.windowed.adopt_window(self.allocator.pages_of(cached[start:end]), copies)
        self.allocator.free(copies)

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
        holders = list(holders)
        owned = sum(-(-(s.kv_len - s.shared_len) // ps) for s in holders)
        cache = self.cache
        usage = {
            "total": self.allocator.capacity_tokens,
            "free": self.allocator.num_free * ps,
            "in_use": owned * ps,
            "cached": (cache.total_pages if cache is not None else 0) * ps,
            "cached_evictable": (cache.evictable_pages() if cache is not None else 0) * ps,
            "page_size": ps,
        }
        if self.windowed is not None:
            usage.update(self.window_usage(holders))
        return usage

    def window_usage(self, holders: Iterable[Sequence]) -> dict[str, int]:
        """The sliding pool's tokens by owner, in whole pages: what running
        sequences hold of their own tokens, and what the cache holds (all
        of it can be given back but what running sequences still read)."""
        windowed, ps = self.windowed, self.page_size
        own = [windowed.page_map[self.allocator.pages_of(s.slots[s.shared_len :])] for s in holders]
        in_use = sum(int((pages != 0).sum()) for pages in own)
        cached = evictable = 0
        if self.cache is not None:
            pages = self.allocator.pages_of(self.cache.all_slots())
            held = windowed.page_map[pages] != 0
            cached = int(held.sum())
            evictable = int((held & ~self._window_protected()[pages]).sum())
        return {"window_total": windowed.window_pages.capacity_tokens,
                "window_free": windowed.window_pages.num_free * ps, "window_in_use": in_use * ps,
                "window_cached": cached * ps, "window_cached_evictable": evictable * ps,
                "window": windowed.window}

    def token_usage(self) -> float:
        """Share of the KV cache that running requests need, as SGLang counts
        it: pages neither free nor evictable (their own pages and the cached
        prefixes they lock). An idle server reads 0 however much it caches."""
        evictable = self.cache.evictable_pages() if self.cache is not None else 0
        used = 1.0 - (self.allocator.num_free + evictable) / self.allocator.capacity
        if self.windowed is None:
            return used
        figures = self.window_usage(self._holders)
        free = figures["window_free"] + figures["window_cached_evictable"]
        return max(used, 1.0 - free / figures["window_total"])

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
            return None if self.windowed is None else self.windowed.window_problem()
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


def _draft_kv_end(seq: Sequence) -> int:
    """Where the draft model's KV of `seq` ends (STANDALONE, after steps it
    skipped): the prefix cache takes nothing past it, since a drafting
    request starting from a cached prefix drafts over the draft's KV there."""
    return seq.num_tokens if seq.draft_kv_len is None else seq.draft_kv_len
