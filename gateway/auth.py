"""Bearer API keys, stored only as SHA-256 hashes in Redis (`API_KEYS_KEY`)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from services import protocol as p

KEY_PREFIX = "tf-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    hash: str
    name: str  # the tenant: response caches, and later the ledger, are scoped by it
    cache_mode: p.CacheMode | None = None  # the response caches for its requests that ask for none


async def register_key(redis: aioredis.Redis, name: str, key: str | None = None,
                       cache_mode: p.CacheMode | None = None) -> str:
    """Stores the hash of `key` (a new random key when None) under `name`; returns the key."""
    key = key or KEY_PREFIX + secrets.token_urlsafe(32)
    record = {"name": name, "created": int(time.time())} | ({"cache": cache_mode} if cache_mode else {})
    await redis.hset(p.API_KEYS_KEY, hash_key(key), json.dumps(record))
    return key


async def authenticate(redis: aioredis.Redis, authorization: str | None) -> ApiKey | None:
    """The known bearer key, else None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    digest = hash_key(authorization[7:].strip())
    record = await redis.hget(p.API_KEYS_KEY, digest)
    if not record:
        return None
    fields = json.loads(record)
    return ApiKey(digest, fields["name"], fields.get("cache"))
