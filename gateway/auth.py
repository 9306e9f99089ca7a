"""Bearer API keys, stored only as SHA-256 hashes in Redis (`API_KEYS_KEY`)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time

import redis.asyncio as aioredis

from services import protocol as p

KEY_PREFIX = "tf-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def register_key(redis: aioredis.Redis, name: str, key: str | None = None) -> str:
    """Stores the hash of `key` (a new random key when None) under `name`; returns the key."""
    key = key or KEY_PREFIX + secrets.token_urlsafe(32)
    await redis.hset(p.API_KEYS_KEY, hash_key(key), json.dumps({"name": name, "created": int(time.time())}))
    return key


async def authenticate(redis: aioredis.Redis, authorization: str | None) -> tuple[str, str] | None:
    """(key hash, key name) for a known bearer key, else None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    digest = hash_key(authorization[7:].strip())
    record = await redis.hget(p.API_KEYS_KEY, digest)
    return (digest, json.loads(record)["name"]) if record else None
