"""The semantic response cache: a completion stored for one conversation answers another whose embedding is
close enough (cosine >= `semantic_threshold`) and which `cache.guard` does not veto.

Redis is the record of truth, shared by every router (which looks up) and every worker (which stores). Per
tenant and model ("scope"):

- `entry_key`: one key per entry, JSON {text, vector, completion}, expiring after `semantic_ttl_s`;
- `ids_key`: a ZSET of the live entry ids scored by insertion time, to evict the oldest past
  `semantic_max_entries`;
- `log_key`: a stream of additions {id, vector}, from which each process's in-memory usearch index catches up
  with one XREAD per lookup; a process that has never seen the scope (or fell behind the log's trimming)
  rebuilds from the ZSET instead;
- `seq_key`: the counter entry ids come from (consecutive per scope, so a reader can tell it missed some).

Tenants never share an index or a key: isolation is by construction, not by a filter at lookup.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote

import numpy as np
import redis.asyncio as aioredis
from usearch.index import Index

from services.base.protocol import PREFIX, CachedCompletion
from services.base.settings import CacheSettings

from .embedder import DIM, Embedder, shared_embedder
from .guard import conflict

log = logging.getLogger(__name__)

KEY_PREFIX = f"{PREFIX}:semcache"


def scope_prefix(tenant: str, model: str) -> str:
    # Quoted, so a ':' (or a glob character) in a tenant or model name cannot make two scopes share keys.
    return f"{KEY_PREFIX}:{quote(tenant, safe='')}:{quote(model, safe='')}"


def entry_key(tenant: str, model: str, entry_id: int | str) -> str:
    return f"{scope_prefix(tenant, model)}:entry:{entry_id}"


def ids_key(tenant: str, model: str) -> str:
    return f"{scope_prefix(tenant, model)}:ids"


def log_key(tenant: str, model: str) -> str:
    return f"{scope_prefix(tenant, model)}:log"


def seq_key(tenant: str, model: str) -> str:
    return f"{scope_prefix(tenant, model)}:seq"


MAX_SCOPES = 64  # indexes held in memory per process (at most semantic_max_entries x 1.5 KB each)
CANDIDATES = 4  # nearest entries examined per lookup: the guard may veto the closest ones
LOG_PAGE = 1000  # log entries per XREAD when catching up
REBUILD_PAGE = 1000  # entry keys per MGET when rebuilding

# One step, so that ids enter the log in the order they were taken (a reader relies on that to notice a
# gap) and the size bound holds whatever the number of writers. Entry keys are built here from a prefix:
# fine on a single Redis server, which is what tokenfleet runs (see services/base/streams.py for the others).
# KEYS: seq, ids, log. ARGV: entry key prefix, entry JSON, vector (base64), ttl_s, max_entries, now, log maxlen.
_STORE = """
local id = redis.call('INCR', KEYS[1])
redis.call('SET', ARGV[1] .. id, ARGV[2], 'EX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[6], id)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[7], '*', 'id', id, 'vector', ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (ARGV[6] - ARGV[4]))
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[5])
if excess > 0 then
  for _, old in ipairs(redis.call('ZRANGE', KEYS[2], 0, excess - 1)) do redis.call('DEL', ARGV[1] .. old) end
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return id
"""


def encode_vector(vector: np.ndarray) -> str:
    """A unit embedding as base64 of its little-endian float32 bytes (what Redis keeps)."""
    vector = np.asarray(vector, dtype="<f4").reshape(-1)
    if vector.shape != (DIM,):
        raise ValueError(f"expected a {DIM}-dimensional embedding, got shape {vector.shape}")
    return base64.b64encode(vector.tobytes()).decode("ascii")


def decode_vector(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4").astype(np.float32)


@dataclass(frozen=True)
class SemanticHit:
    entry_id: str
    similarity: float
    cached_text: str
    completion: CachedCompletion


class ScopeIndex:
    """This process's copy of one scope's vectors: what the log said up to `cursor`. It may still hold ids
    whose Redis entries are gone (expired, evicted); a lookup that meets one drops it."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.lock = asyncio.Lock()  # one catch-up at a time, or two lookups would add the same entries
        self.reset(cursor=None, last_id=0)

    def reset(self, cursor: str | None, last_id: int) -> None:
        self.index = Index(ndim=DIM, metric="ip", dtype="f32")  # inner product of unit vectors: the cosine
        self.order: deque[int] = deque()  # ids oldest first
        self.cursor = cursor  # the last log entry applied; None: never loaded
        self.last_id = last_id  # the entry id that log entry added

    def add(self, entry_id: int, vector: np.ndarray) -> None:
        if entry_id in self.index:
            return
        self.index.add(entry_id, vector)
        self.order.append(entry_id)
        while len(self.order) > self.max_entries:  # Redis evicted these too, the oldest first
            self.index.remove(self.order.popleft())

    def discard(self, entry_id: int) -> None:
        self.index.remove(entry_id)  # its id stays in `order` until it ages out: removing twice is harmless

    def nearest(self, vector: np.ndarray, count: int) -> list[tuple[int, float]]:
        """(entry id, cosine similarity), most similar first."""
        if len(self.index) == 0:
            return []
        matches = self.index.search(vector, count)
        return [(int(key), 1.0 - float(distance)) for key, distance in zip(matches.keys, matches.distances,
                                                                           strict=True)]


class SemanticCache:
    """Looks up and stores completions by meaning. One per process; safe to share between coroutines."""

    def __init__(self, redis: aioredis.Redis, settings: CacheSettings | None = None,
                 embedder: Embedder | None = None, guard: Callable[[str, str], str | None] = conflict,
                 candidates: int = CANDIDATES, max_scopes: int = MAX_SCOPES):
        self.redis = redis  # a decode_responses=True client (services.base.redis_client.connect)
        self.settings = settings or CacheSettings()
        self._embedder = embedder
        self.guard = guard  # (query, cached text) -> why not, or None
        self.candidates = candidates
        self.max_scopes = max_scopes
        # (tenant, model) -> its index, least recently used first: a dropped one is rebuilt from Redis when asked.
        self._scopes: OrderedDict[tuple[str, str], ScopeIndex] = OrderedDict()
        self._store = redis.register_script(_STORE)

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = shared_embedder()  # loaded on first use: a router with the cache off never pays
        return self._embedder

    async def vector(self, text: str) -> np.ndarray:
        """The embedding of `text`, computed off the event loop (a few ms of CPU)."""
        return await asyncio.to_thread(self.embedder.embed_one, text)

    async def lookup(self, tenant: str, model: str, text: str, vector: np.ndarray) -> SemanticHit | None:
        """The closest entry of this tenant and model at or above the threshold that the guard lets answer
        `text` (whose embedding is `vector`), or None."""
        scope = await self._caught_up(tenant, model)
        threshold = self.settings.semantic_threshold
        candidates = [(i, s) for i, s in scope.nearest(vector, self.candidates) if s >= threshold]
        if not candidates:
            return None
        raws = await self.redis.mget([entry_key(tenant, model, entry_id) for entry_id, _ in candidates])
        for (entry_id, similarity), raw in zip(candidates, raws, strict=True):
            if raw is None:  # expired or evicted since this process indexed it
                scope.discard(entry_id)
                continue
            entry = json.loads(raw)
            if reason := self.guard(text, entry["text"]):
                log.debug("semantic cache: entry %s (similarity %.3f) vetoed: %s", entry_id, similarity, reason)
                continue
            return SemanticHit(str(entry_id), similarity, entry["text"],
                               CachedCompletion.model_validate(entry["completion"]))
        return None

    async def store(self, tenant: str, model: str, text: str, vector: np.ndarray,
                    completion: CachedCompletion) -> str:
        """Adds an entry; returns its id. Evicts this scope's oldest entries past `semantic_max_entries`."""
        encoded = encode_vector(vector)
        entry = json.dumps({"text": text, "vector": encoded, "completion": completion.model_dump(mode="json")},
                           separators=(",", ":"))
        s = self.settings
        keys = [seq_key(tenant, model), ids_key(tenant, model), log_key(tenant, model)]
        args = [entry_key(tenant, model, ""), entry, encoded, s.semantic_ttl_s, s.semantic_max_entries,
                repr(time.time()), s.semantic_max_entries]
        return str(await self._store(keys=keys, args=args))

    async def clear(self, tenant: str, model: str) -> None:
        """Deletes every entry of this tenant and model (and this process's index of them)."""
        ids = await self.redis.zrange(ids_key(tenant, model), 0, -1)
        keys = [seq_key(tenant, model), ids_key(tenant, model), log_key(tenant, model)]
        await self.redis.delete(*keys, *(entry_key(tenant, model, entry_id) for entry_id in ids))
        self._scopes.pop((tenant, model), None)

    async def _caught_up(self, tenant: str, model: str) -> ScopeIndex:
        scope = self._scopes.get((tenant, model))
        if scope is None:
            scope = self._scopes[tenant, model] = ScopeIndex(self.settings.semantic_max_entries)
            while len(self._scopes) > self.max_scopes:  # bounds this process's memory, whatever the tenants
                self._scopes.popitem(last=False)
        self._scopes.move_to_end((tenant, model))
        async with scope.lock:
            if scope.cursor is None:
                await self._rebuild(tenant, model, scope)
            if not await self._read_log(tenant, model, scope):
                await self._rebuild(tenant, model, scope)
                await self._read_log(tenant, model, scope)  # from a fresh snapshot: a gap now waits for the next
        return scope

    async def _read_log(self, tenant: str, model: str, scope: ScopeIndex) -> bool:
        """Applies the log past the cursor. False if entries were missed: the log was trimmed past this
        process's cursor, or the whole scope expired and ids started again from 1."""
        while True:
            reply = await self.redis.xread({log_key(tenant, model): scope.cursor}, count=LOG_PAGE)
            entries = reply[0][1] if reply else []
            for stream_id, fields in entries:
                entry_id = int(fields["id"])
                if entry_id != scope.last_id + 1:
                    return False
                scope.add(entry_id, decode_vector(fields["vector"]))
                scope.cursor, scope.last_id = stream_id, entry_id
            if len(entries) < LOG_PAGE:
                return True

    async def _rebuild(self, tenant: str, model: str, scope: ScopeIndex) -> None:
        """Loads every live entry from the ZSET; the log resumes from the entry added last."""
        async with self.redis.pipeline(transaction=True) as pipe:  # one snapshot: no entry between the two
            pipe.get(seq_key(tenant, model))
            pipe.xrevrange(log_key(tenant, model), count=1)
            pipe.zrange(ids_key(tenant, model), 0, -1)
            last_id, last_logged, ids = await pipe.execute()
        scope.reset(cursor=last_logged[0][0] if last_logged else "0-0", last_id=int(last_id or 0))
        for start in range(0, len(ids), REBUILD_PAGE):
            page = ids[start:start + REBUILD_PAGE]
            raws = await self.redis.mget([entry_key(tenant, model, entry_id) for entry_id in page])
            for entry_id, raw in zip(page, raws, strict=True):
                if raw is not None:
                    scope.add(int(entry_id), decode_vector(json.loads(raw)["vector"]))
