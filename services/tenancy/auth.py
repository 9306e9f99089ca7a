"""Bearer API keys, stored only as SHA-256 hashes in Redis (`API_KEYS_KEY`), each with its limits (rate
limits and a USD budget, enforced by `services/tenancy/budgets.py`)."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Literal, get_args

import redis.asyncio as aioredis

from services.base import protocol as p
from services.base.redis_client import as_text

KEY_PREFIX = "tf-"
MAX_NAME = 128
KEY_ID_LENGTH = 12  # hex digits of a key's hash that name it in `keys list` / `keys revoke`
BudgetPeriod = Literal["day", "month", "total"]  # day and month are UTC calendar periods


def prefix_scope(name: str, prefix_group: str | None) -> str:
    """Whose cached KV prefixes a key's requests may reuse: its sharing group's, else only its tenant's."""
    return f"group:{prefix_group}" if prefix_group else f"tenant:{name}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    hash: str
    name: str  # the tenant: response caches, and later the ledger, are scoped by it
    cache_mode: p.CacheMode | None = None  # the response caches for its requests that ask for none
    # Limits; None: unlimited. tpm counts a request's estimated prompt tokens plus all it may generate.
    rpm: int | None = None
    tpm: int | None = None
    budget_usd: float | None = None  # list price (the price table) per `budget_period`
    budget_period: BudgetPeriod = "month"
    admin: bool = False  # the finance API shows an admin every tenant's rows (a tenant's key: its own)
    sla_class: str | None = None  # for its requests that name none (the ledger judges each task by its class)
    # Keys in one group share prefix-cache hits (an admin's choice, e.g. one product's system prompt across
    # its keys); None: the key's tenant shares with nobody else.
    prefix_group: str | None = None

    @property
    def prefix_scope(self) -> str:
        return prefix_scope(self.name, self.prefix_group)

    @property
    def limited(self) -> bool:
        """Whether admission must ask Redis about this key's limits (an unlimited key costs no round trip)."""
        return self.rpm is not None or self.tpm is not None or self.budget_usd is not None


async def register_key(redis: aioredis.Redis, name: str, key: str | None = None,
                       cache_mode: p.CacheMode | None = None, *, rpm: int | None = None, tpm: int | None = None,
                       budget_usd: float | None = None, budget_period: BudgetPeriod = "month",
                       admin: bool = False, sla_class: str | None = None, prefix_group: str | None = None) -> str:
    """Stores the hash of `key` (a new random key when None) under `name`, with its limits; returns the key."""
    if not 0 < len(name) <= MAX_NAME:  # the ledger's tenant column
        raise ValueError(f"a key's name is 1 to {MAX_NAME} characters")
    if budget_period not in get_args(BudgetPeriod):
        raise ValueError(f"budget_period must be one of {', '.join(get_args(BudgetPeriod))}")
    if any(limit is not None and limit < 0 for limit in (rpm, tpm, budget_usd)):
        raise ValueError("limits cannot be negative")
    key = key or KEY_PREFIX + secrets.token_urlsafe(32)
    limits = {"rpm": rpm, "tpm": tpm, "budget_usd": budget_usd}
    record = {"name": name, "created": int(time.time())} | ({"cache": cache_mode} if cache_mode else {}) \
        | {field: value for field, value in limits.items() if value is not None} \
        | ({"budget_period": budget_period} if budget_usd is not None else {}) | ({"admin": True} if admin else {}) \
        | ({"sla_class": sla_class} if sla_class else {}) | ({"prefix_group": prefix_group} if prefix_group else {})
    await redis.hset(p.API_KEYS_KEY, hash_key(key), json.dumps(record))
    return key


async def list_keys(redis: aioredis.Redis) -> list[tuple[str, dict]]:
    """(id, stored record) of every key, oldest first. The id is the start of the key's hash: the key itself
    is never stored, so it cannot be shown again."""
    records = await redis.hgetall(p.API_KEYS_KEY)
    listed = [(as_text(digest)[:KEY_ID_LENGTH], json.loads(record)) for digest, record in records.items()]
    return sorted(listed, key=lambda item: (item[1].get("created", 0), item[0]))


async def revoke_key(redis: aioredis.Redis, key_or_id: str) -> str:
    """Deletes a key, given whole or by its id from `list_keys` (at least 8 of its hex digits); returns its name.
    Requests with it are refused (401) from then on (a gateway's TOKENFLEET_GATEWAY_DEV_KEY is registered again
    at its next start). ValueError when no key, or more than one, matches."""
    if await redis.hexists(p.API_KEYS_KEY, hash_key(key_or_id)):  # the key itself, whatever its form
        digests = [hash_key(key_or_id)]
    elif re.fullmatch(r"[0-9a-fA-F]{8,64}", key_or_id):
        digests = [d for d in map(as_text, await redis.hkeys(p.API_KEYS_KEY)) if d.startswith(key_or_id.lower())]
    elif key_or_id.startswith(KEY_PREFIX):
        digests = []
    else:
        raise ValueError("give the key itself, or at least 8 hex digits of its id (`tokenfleet keys list`)")
    if len(digests) != 1:
        raise ValueError(f"{len(digests) or 'no'} keys match {key_or_id!r}")
    record = await redis.hget(p.API_KEYS_KEY, digests[0])
    await redis.hdel(p.API_KEYS_KEY, digests[0])
    return json.loads(record)["name"] if record else "?"


async def authenticate(redis: aioredis.Redis, authorization: str | None) -> ApiKey | None:
    """The known bearer key, else None."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    return await key_by_hash(redis, hash_key(authorization[7:].strip()))


async def key_by_hash(redis: aioredis.Redis, digest: str) -> ApiKey | None:
    """The key stored under this hash (work done for a key later, e.g. a batch job, looks its limits up again)."""
    record = await redis.hget(p.API_KEYS_KEY, digest)
    if not record:
        return None
    fields = json.loads(record)
    return ApiKey(digest, fields["name"], fields.get("cache"), fields.get("rpm"), fields.get("tpm"),
                  fields.get("budget_usd"), fields.get("budget_period", "month"), fields.get("admin") is True,
                  fields.get("sla_class"), fields.get("prefix_group"))
