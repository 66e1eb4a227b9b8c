"""What a pool replica reports of its prefix cache, and how a prompt is matched against it:
shared by the pools (which write reports) and the router (which reads them), so it lives below
both (router/prefix_affinity.py is the routing policy over it)."""

from __future__ import annotations

from typing import Any, Sequence

from cluster.engine.block_manager import BlockManager, extend_chain

DIGEST_LIMIT = 4096  # cached block hashes a replica reports (8 bytes each: 32 KiB)
HASH_BYTES = 8


def cache_report(blocks: BlockManager) -> dict[str, Any]:
    """The routing-stats entries describing a replica's prefix cache (empty when it has none)."""
    if not blocks.enable_prefix_caching:
        return {}
    hashes = blocks.cached_hashes(DIGEST_LIMIT)
    return {"block_size": blocks.block_size, "cached_blocks": b"".join(h[:HASH_BYTES] for h in hashes)}


def prompt_hashes(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """Short hashes of the prompt's blocks a prefix cache could serve: full blocks only, and
    never the one holding the last token (the engine always computes that one)."""
    tokens = list(token_ids)
    chain = extend_chain([], tokens, block_size, salt, max(len(tokens) - 1, 0) // block_size)
    return [h[:HASH_BYTES] for h in chain]
