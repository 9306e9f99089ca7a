"""The chained key of a full KV block, and its hash: the same in every process, so the router can compute
a prompt's block hashes and ask the prefix directory which worker holds them.

A key is (hash of the parent block's key, the block's token ids); the first block's parent is the root,
which a cache salt moves. Python's `hash` of ints and tuples of ints does not depend on PYTHONHASHSEED
(only str and bytes hashes are randomized), so equal keys hash equally in any CPython of the same version.
"""

from __future__ import annotations

import hashlib

BlockKey = tuple[int, tuple[int, ...]]

# The parent hash of a sequence's first block.
ROOT = 0


def root(cache_salt: str | None) -> int:
    """A salted chain starts elsewhere; sha256, unlike `hash(str)`, is the same in every process."""
    return ROOT if cache_salt is None else int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "big")


def extend_keys(keys: list[BlockKey], token_ids: list[int], block_size: int, num_blocks: int,
                cache_salt: str | None) -> list[BlockKey]:
    """Appends the keys of blocks len(keys) .. num_blocks-1 of `token_ids` to `keys` (in place)."""
    for i in range(len(keys), num_blocks):
        parent = hash(keys[-1]) if keys else root(cache_salt)
        keys.append((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return keys


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[int]:
    """Hashes of the full blocks of a prompt, in order: what the prefix directory is asked about."""
    keys = extend_keys([], token_ids, block_size, len(token_ids) // block_size, cache_salt)
    return [hash(key) for key in keys]
