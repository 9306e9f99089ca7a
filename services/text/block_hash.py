"""The chained key of a full KV block: SHA-256 over the parent block's key and the block's token ids, so a key
stands for the whole prefix up to its block and two different prefixes cannot be made to share one.

A 64-bit chain (Python's `hash` of (parent hash, tokens)) let a prefix whose parent hash collides with
another tenant's reuse that tenant's KV blocks: cache poisoning, vLLM's CVE-2025-25183. The first block's
parent is a root that a cache salt moves (the gateway salts every request with its tenant).

`block_id` shortens a key to a signed 64-bit integer for the fleet's prefix directory (Redis sets, the
router's index), the same in every process. The directory only steers routing: an id collision there can
send a request to a worker that lacks its prefix, never make a worker reuse a wrong block, since the engine
looks blocks up by the full 32-byte key.
"""

from __future__ import annotations

import hashlib
from array import array

BlockKey = bytes  # 32-byte SHA-256 digest

# The parent of an unsalted sequence's first block.
ROOT = bytes(32)


def root(cache_salt: str | None) -> BlockKey:
    return ROOT if cache_salt is None else hashlib.sha256(b"tokenfleet-cache-salt\0" + cache_salt.encode()).digest()


def block_key(parent: BlockKey, tokens: list[int]) -> BlockKey:
    # int64 little-endian: every token id encodes to distinct bytes of a fixed width, so the bytes are unambiguous.
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_id(key: BlockKey) -> int:
    return int.from_bytes(key[:8], "little", signed=True)


def extend_keys(keys: list[BlockKey], token_ids: list[int], block_size: int, num_blocks: int,
                cache_salt: str | None) -> list[BlockKey]:
    """Appends the keys of blocks len(keys) .. num_blocks-1 of `token_ids` to `keys` (in place)."""
    for i in range(len(keys), num_blocks):
        keys.append(block_key(keys[-1] if keys else root(cache_salt), token_ids[i * block_size:(i + 1) * block_size]))
    return keys


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Directory ids of the full blocks of a prompt, in order: what the prefix directory is asked about."""
    return [block_id(key) for key in extend_keys([], token_ids, block_size, len(token_ids) // block_size, cache_salt)]
