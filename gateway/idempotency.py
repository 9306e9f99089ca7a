"""`Idempotency-Key`: a key repeated within its TTL returns the first request's result, never a second run."""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.base import protocol as p


@dataclass(frozen=True)
class FirstRequest:
    request_id: str
    created: int
    result: dict | None  # the whole response, once the first request finished without streaming


class Idempotency:
    def __init__(self, redis: aioredis.Redis, ttl_s: int):
        self.redis, self.ttl_s = redis, ttl_s

    async def claim(self, key_hash: str, key: str, message: p.GenerateRequest) -> FirstRequest | None:
        """None when this request is the first with the key (it is recorded); else the first one."""
        record = json.dumps({"request_id": message.request_id, "created": message.created})
        name = p.idempotency_key(key_hash, key)
        if await self.redis.set(name, record, nx=True, ex=self.ttl_s):
            return None
        first = json.loads(await self.redis.get(name) or record)
        result = await self.redis.get(name + ":result")
        return FirstRequest(first["request_id"], first["created"], json.loads(result) if result else None)

    async def store_result(self, key_hash: str, key: str, body: dict) -> None:
        await self.redis.set(p.idempotency_key(key_hash, key) + ":result", json.dumps(body), ex=self.ttl_s)

    async def forget(self, key_hash: str, key: str) -> None:
        """The first request was refused before it was enqueued (429, 503): a retry with the key must run."""
        await self.redis.delete(p.idempotency_key(key_hash, key))
