"""Paged KV block allocator with automatic prefix caching (plain ints, no torch).

A block holds `block_size` consecutive tokens of one sequence. Full blocks are named by a
chained hash (hash of the parent block's hash + this block's token ids), so two requests
sharing a prompt prefix share its blocks:

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial) |
    hashes   |    h0     | h1=H(h0,..)|   none: not cacheable |

h0's parent is a fixed root, or, for a request with a `cache_salt`, the salt's own hash: only
requests with the same salt (or none) can share blocks.

Blocks whose reference count drops to 0 go to the back of the free queue but keep their
hash, so a later request can revive them; allocation takes from the front (least recently
freed first) and only then forgets the hash. `num_free_blocks` counts both.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cluster.engine.request import Request

_ROOT = b"tandem-prefix-v1"


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def hash_salt(salt: str) -> bytes:
    return hashlib.blake2b(_ROOT + b"/salt/" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def extend_chain(hashes: list[bytes], token_ids: list[int], block_size: int, salt: str | None,
                 num_blocks: int) -> list[bytes]:
    """Extend `hashes` (a prefix of this chain, often empty) to the first `num_blocks` full blocks
    of `token_ids`. A salted chain starts from the salt's own root: no hash in common."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else _ROOT if salt is None else hash_salt(salt)
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from cache

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks that already hold a prefix of `req.token_ids` (not yet referenced).

        At least the last token is always left to compute, so the request gets logits
        and never writes into a shared block.
        """
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in req.block_hashes[:max_blocks]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix_len(self, token_ids: list[int], salt: str | None) -> int:
        """How many tokens of this prompt `find_cached_prefix` would serve now, without a
        request (read-only, so safe from another thread than the engine's: a replica's estimate
        of the work a queued prompt adds)."""
        if not self.enable_prefix_caching:
            return 0
        hashes: list[bytes] = []
        for i in range((len(token_ids) - 1) // self.block_size):
            extend_chain(hashes, token_ids, self.block_size, salt, i + 1)
            if hashes[i] not in self.cached:
                return i * self.block_size
        return len(hashes) * self.block_size

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Make `req.block_ids` cover num_computed_tokens (+ cached) + num_new_tokens.

        `cached` (from find_cached_prefix) is taken on the request's first allocation, and
        counted then as one lookup (prefix_queries, prefix_hits): a request that waits for
        free blocks looks up again each step, but is counted once, when it is admitted.
        Returns False, changing nothing, when there are not enough free blocks.
        """
        looked_up, cached = cached is not None, cached or []
        total = req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_ids) - len(cached)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        if need + revived > len(self.free_queue):
            return False
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        req.block_ids.extend(cached)
        req.block_ids.extend(self._pop_free() for _ in range(max(need, 0)))
        if looked_up:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(cached) * self.block_size
        return True

    def free(self, req: Request) -> None:
        """Drop the request's references; tail blocks are freed first so they are evicted first."""
        for block in reversed(req.block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        req.block_ids = []

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past those holding its first `num_tokens` tokens (the
        blocks a step reserved for drafts that were rejected). They were never published to the
        prefix cache, so they go to the front of the free queue, reused before cached ones."""
        keep = self.blocks_needed(num_tokens)
        for block in reversed(req.block_ids[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)
        del req.block_ids[keep:]

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the request's newly computed full blocks for prefix reuse."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        self._extend_hashes(req, num_full * self.block_size)
        for i in range(num_full):
            h = req.block_hashes[i]
            block = req.block_ids[i]
            if h not in self.cached and block not in self.block_hash:
                self.cached[h] = block
                self.block_hash[block] = h

    def cached_hashes(self, limit: int) -> list[bytes]:
        """Up to `limit` hashes of cached blocks: those in use first, then free ones, the most
        recently freed (last to be evicted) first. Safe to call from another thread than the
        one allocating: it reads a snapshot of the hashes, and walks the free queue from its back
        in slices taken whole under the GIL, only as far as the free cached blocks it reports
        (never the whole queue: with a large cache it holds ~all blocks, most of them uncached);
        if the owner changes the queue mid-walk, what was found so far is the answer."""
        owners, refs = list(self.block_hash.items()), self.ref_counts
        hashes = [h for b, h in owners if refs[b] > 0][:limit]
        named = {b: h for b, h in owners if refs[b] == 0}
        wanted = min(limit - len(hashes), len(named))
        newest_first = reversed(self.free_queue)
        try:
            while wanted > 0:
                part = list(islice(newest_first, 1024))
                if not part:
                    break
                for block in part:
                    h = named.get(block)
                    if h is not None:
                        hashes.append(h)
                        wanted -= 1
                        if not wanted:
                            break
        except RuntimeError:  # the engine thread changed the free queue between two slices
            pass
        return hashes

    def uncache(self, hashes: list[bytes]) -> None:
        """Forget the free cached blocks with these hashes (throwaway prompts)."""
        for h in hashes:
            block = self.cached.get(h)
            if block is not None and self.ref_counts[block] == 0:
                self._forget(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.block_hash):
            if self.ref_counts[block] == 0:
                self._forget(block)

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        extend_chain(req.block_hashes, req.token_ids, self.block_size, req.params.cache_salt,
                     num_tokens // self.block_size)

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        self._forget(block)
        self.ref_counts[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
