"""Per-key rate limits (requests and tokens per minute) and USD budgets that cannot be overspent.

Admission is one Lua script: it checks the minute's counters and reserves the request's estimated list cost
(the most it can cost: every prompt token uncached, every token it may generate) against the key's budget
for the current period, atomically, so concurrent requests cannot all see the same headroom (LiteLLM #34732:
check-then-spend lets N parallel requests through a budget that fits one). The accounting service settles a
reservation with the actual cost when it writes the request's ledger row: `settle(redis, request_id, usd)`.

Amounts are integer nano-USD in Redis: integer sums are exact, so a budget that fits N estimates admits N.

Redis, per key hash H:
  tf:rl:H:<minute start>        hash  requests, tokens                      expires 2 minutes after its start
  tf:budget:H:<period>          hash  spent, reserved, r:<request id>       expires its period's end + margin
  tf:budget:H:<period>:open     zset  request id -> sweep deadline           (same)
  tf:budget:res:<request id>    hash  key, period, amount, state, charged    expires after RECORD_TTL_S
A reservation never settled (its gateway or worker died, its event was lost) is swept lazily: the next
admission of that key and period returns its amount once its deadline (the request's timeout +
RESERVATION_MARGIN_S) passed. Only an admission reads `reserved`, so sweeping there is enough and needs no
background task. A settle that comes after the sweep still charges the actual cost (its record outlives the
deadline).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis

from services.base import protocol as p
from services.openai_api.admission import served_models
from services.openai_api.schemas import RequestError
from services.tenancy.auth import ApiKey, BudgetPeriod
from services.tenancy.prices import PriceTable
from services.text.prompt_encoder import PromptEncoder

UNITS_PER_USD = 1_000_000_000
WINDOW_S = 60
# A reservation is held for its request's timeout plus this (the queue, and the accounting service's lag in
# settling it); a request that outlives its hold, or whose end nobody reported, holds no budget past it.
RESERVATION_MARGIN_S = 300
RECORD_TTL_S = 2 * 86_400  # a late settle still finds where to charge
PERIOD_MARGIN_S = RECORD_TTL_S  # a period's counters outlive the settles of its last reservations
SWEEP_BATCH = 100  # expired reservations returned per admission: bounded work inside the script
TEMPLATE_TOKENS = 8  # per message, for a chat template's role markers (generous: an over-estimate is safe)

# Fixed one-minute windows, not sliding ones: O(1) memory and work per key (one hash of two counters), exact
# counts, and an exact Retry-After (the counters reset at the window's end). A sliding log costs a sorted-set
# entry per request (and a sum over them for tokens); the price of fixed windows is that a client can spend
# up to twice its limit across one window boundary, which per-minute limits tolerate.
_ADMIT = """
local now, rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rpm >= 0 and tonumber(redis.call('HGET', KEYS[1], 'requests') or '0') + 1 > rpm then return 1 end
if tpm >= 0 and tonumber(redis.call('HGET', KEYS[1], 'tokens') or '0') + tokens > tpm then return 2 end
local budget, estimate, rid = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[11]
-- the same request admitted again (a batch line re-run): it holds its reservation already
if budget >= 0 and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
if budget >= 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[14]))
  for _, old in ipairs(expired) do
    redis.call('HINCRBY', KEYS[2], 'reserved', -tonumber(redis.call('HGET', KEYS[2], 'r:' .. old) or '0'))
    redis.call('HDEL', KEYS[2], 'r:' .. old)
    redis.call('ZREM', KEYS[3], old)
  end
  local spent = tonumber(redis.call('HGET', KEYS[2], 'spent') or '0')
  local reserved = tonumber(redis.call('HGET', KEYS[2], 'reserved') or '0')
  if spent + reserved + estimate > budget then return 3 end
  redis.call('HINCRBY', KEYS[2], 'reserved', estimate)
  redis.call('HSET', KEYS[2], 'r:' .. rid, estimate)
  redis.call('ZADD', KEYS[3], ARGV[9], rid)
  if tonumber(ARGV[8]) > 0 then
    redis.call('EXPIRE', KEYS[2], ARGV[8])
    redis.call('EXPIRE', KEYS[3], ARGV[8])
  end
  redis.call('HSET', KEYS[4], 'key', ARGV[12], 'period', ARGV[13], 'amount', estimate, 'state', 'open')
  redis.call('EXPIRE', KEYS[4], ARGV[10])
end
if rpm >= 0 or tpm >= 0 then
  redis.call('HINCRBY', KEYS[1], 'requests', 1)
  redis.call('HINCRBY', KEYS[1], 'tokens', tokens)
  redis.call('EXPIRE', KEYS[1], ARGV[7])
end
return 0
"""

# settle: return the reservation (unless swept), charge the actual cost, and keep the record as settled with what
# it charged: a repeat with the same cost changes nothing, and a lower one (the row was cut to what its client got)
# gives the difference back. release: return the reservation but keep the record, marked, so that a request
# released in doubt (the gateway lost Redis while enqueueing it) that did run after all is still charged when it is
# settled.
_CLOSE = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or (ARGV[1] == 'release' and (state == 'released' or state == 'settled')) then return -1 end
local actual = tonumber(ARGV[2])
if state == 'settled' then
  local charged = tonumber(redis.call('HGET', KEYS[1], 'charged') or '0')
  if actual == charged then return -1 end
  if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('HINCRBY', KEYS[2], 'spent', actual - charged) end
  redis.call('HSET', KEYS[1], 'charged', actual)
  return 0
end
local amount = 0
if state == 'open' and redis.call('ZREM', KEYS[3], ARGV[3]) == 1 then
  amount = tonumber(redis.call('HGET', KEYS[2], 'r:' .. ARGV[3]) or '0')
  redis.call('HINCRBY', KEYS[2], 'reserved', -amount)
  redis.call('HDEL', KEYS[2], 'r:' .. ARGV[3])
end
if ARGV[1] == 'release' then
  redis.call('HSET', KEYS[1], 'state', 'released')
  return amount
end
if actual > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'spent', actual)
end
redis.call('HSET', KEYS[1], 'state', 'settled', 'charged', actual)
return amount
"""


def reservation_key(request_id: str) -> str:
    return f"{p.PREFIX}:budget:res:{request_id}"


def budget_key(key_hash: str, period_id: str) -> str:
    return f"{p.PREFIX}:budget:{key_hash}:{period_id}"


def window_key(key_hash: str, window_start: int) -> str:
    return f"{p.PREFIX}:rl:{key_hash}:{window_start}"


def period_of(period: BudgetPeriod, now: float) -> tuple[str, float | None]:
    """The period `now` falls in (its id) and the seconds until it ends (None: it never does). UTC."""
    if period == "total":
        return "total", None
    at = datetime.fromtimestamp(now, UTC)
    start = at.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return start.strftime("d%Y%m%d"), (start + timedelta(days=1)).timestamp() - now
    start = start.replace(day=1)
    return start.strftime("m%Y%m"), (start + timedelta(days=32)).replace(day=1).timestamp() - now


def _units(usd: float, rounding=round) -> int:
    return int(rounding(round(usd * UNITS_PER_USD, 3)))  # the inner round drops float noise (8.0000000001)


@dataclass(frozen=True)
class Estimate:
    prompt_tokens: int
    output_tokens: int  # max_tokens x n
    usd: float

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class BudgetState:
    period: str
    spent_usd: float
    reserved_usd: float


def _too_many(kind: str, limit: int, message: str, retry_after: float | None) -> RequestError:
    body = p.ErrorBody(message=f"Rate limit reached for {kind} per minute: limit {limit}. {message}", type=kind,
                       code="rate_limit_exceeded", status=429)
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None \
        else {"x-should-retry": "false"}
    return RequestError(body, headers)


def _over_budget(api_key: ApiKey, message: str, retry_after: float | None) -> RequestError:
    body = p.ErrorBody(message=f"You exceeded your current quota (budget ${api_key.budget_usd:g} per "
                               f"{api_key.budget_period}): {message}", type="insufficient_quota",
                       code="insufficient_quota", status=429)
    # Retrying before the period ends cannot succeed: clients that obey x-should-retry (openai's) do not.
    headers = {"x-should-retry": "false"} | ({"Retry-After": str(math.ceil(retry_after))} if retry_after else {})
    return RequestError(body, headers)


async def reserve(redis: aioredis.Redis, api_key: ApiKey, request_id: str, estimate: Estimate, now: float,
                  hold_s: float) -> None:
    """Admits the request under `api_key`'s limits, counting it and reserving `estimate.usd` under
    `request_id` for at most `hold_s`; else raises `RequestError` (429: rate_limit_exceeded or
    insufficient_quota). One round trip."""
    if api_key.tpm is not None and estimate.tokens > api_key.tpm:
        raise _too_many("tokens", api_key.tpm, f"This request may use {estimate.tokens} (estimated prompt "
                                               "tokens + max_tokens x n): lower max_tokens", None)
    window = int(now // WINDOW_S * WINDOW_S)
    period_id, period_left = period_of(api_key.budget_period, now)
    budget = -1 if api_key.budget_usd is None else _units(api_key.budget_usd, math.floor)
    amount = _units(estimate.usd, math.ceil)
    if 0 <= budget < amount:
        raise _over_budget(api_key, f"this request may cost ${estimate.usd:.6g}; lower max_tokens", None)
    code = await redis.register_script(_ADMIT)(
        keys=[window_key(api_key.hash, window), budget_key(api_key.hash, period_id),
              budget_key(api_key.hash, period_id) + ":open", reservation_key(request_id)],
        args=[repr(now), -1 if api_key.rpm is None else api_key.rpm, -1 if api_key.tpm is None else api_key.tpm,
              estimate.tokens, budget, amount, 2 * WINDOW_S,
              0 if period_left is None else math.ceil(period_left) + PERIOD_MARGIN_S,
              repr(now + hold_s), RECORD_TTL_S, request_id, api_key.hash, period_id, SWEEP_BATCH])
    window_left = window + WINDOW_S - now
    if code == 1:
        raise _too_many("requests", api_key.rpm, "Retry after the minute's window ends.", window_left)
    if code == 2:
        raise _too_many("tokens", api_key.tpm, f"This request may use {estimate.tokens}.", window_left)
    if code == 3:
        raise _over_budget(api_key, "the period's spending and reservations leave too little for this request "
                                    f"(up to ${estimate.usd:.6g})", period_left)


async def _close(redis: aioredis.Redis, request_id: str, mode: str, actual: int) -> int | None:
    record = reservation_key(request_id)
    key_hash, period_id = await redis.hmget(record, "key", "period")
    if key_hash is None:
        return None
    amount = await redis.register_script(_CLOSE)(
        keys=[record, budget_key(key_hash, period_id), budget_key(key_hash, period_id) + ":open"],
        args=[mode, actual, request_id])
    return None if amount < 0 else amount


async def settle(redis: aioredis.Redis, request_id: str, actual_usd: float) -> bool:
    """Replaces the request's reservation with its actual cost, in the period it was reserved in; settled again
    with another cost (its ledger row was cut), charges the difference. False (and nothing changes) for a request
    settled already at that cost, or unknown: from a key without a budget, or expired."""
    return await _close(redis, request_id, "settle", _units(actual_usd)) is not None


async def release(redis: aioredis.Redis, request_id: str) -> float:
    """Returns the reservation of a request that did not run (refused after admission, never enqueued): the
    USD it held, 0.0 when there was none to return. A later `settle` still charges an actual cost."""
    return (await _close(redis, request_id, "release", 0) or 0) / UNITS_PER_USD


async def budget_state(redis: aioredis.Redis, api_key: ApiKey, now: float | None = None) -> BudgetState:
    period_id, _ = period_of(api_key.budget_period, time.time() if now is None else now)
    spent, reserved = await redis.hmget(budget_key(api_key.hash, period_id), "spent", "reserved")
    return BudgetState(period_id, int(spent or 0) / UNITS_PER_USD, int(reserved or 0) / UNITS_PER_USD)


class Estimator:
    """A request's most expensive outcome: its prompt tokens (exact where this host has the model's tokenizer,
    else one per UTF-8 byte), every token it may generate (max_tokens, else the rest of the context) for each of
    its n choices, at list price; model="auto" at the priciest model it may use.

    `encoder`: the admission's own (`ContextWindow`'s), so that the prompt is tokenized once: the ids counted here
    are attached to the request, and the admission, router and worker read them instead of tokenizing again."""

    def __init__(self, redis: aioredis.Redis, prices: PriceTable, tiers: tuple[str, ...],
                 catalog_ttl_s: float = 10.0, encoder: PromptEncoder | None = None):
        self.redis, self.prices, self.tiers, self.catalog_ttl_s = redis, prices, tiers, catalog_ttl_s
        self.encoder = encoder or PromptEncoder()
        self._models: dict[str, p.ModelInfo] = {}
        self._loaded_at = -math.inf

    async def estimate(self, message: p.GenerateRequest) -> Estimate:
        served = await self._served(message.model)
        # In a thread: a long prompt tokenizes for a while, and the event loop serves every other request. Models
        # sharing a tokenizer share one tokenization (`PromptEncoder`).
        prompt = await asyncio.to_thread(lambda: max(self._prompt_tokens(message, name, info)
                                                     for name, info in served.items()))
        context = max(info.max_model_len for info in served.values())
        output = (message.sampling.max_tokens or max(context - prompt, 1)) * message.sampling.n
        names = {*self.prices.models, *self.tiers} if message.model == p.AUTO_MODEL else {message.model}
        return Estimate(prompt, output, max(self.prices.estimate(name, prompt, output) for name in names))

    async def _served(self, model: str) -> dict[str, p.ModelInfo]:
        """The models the request may run on: served models change rarely, so they are read every few seconds,
        and at once when the request names one not seen yet."""
        candidates = self.tiers if model == p.AUTO_MODEL else (model,)
        stale = time.monotonic() - self._loaded_at > self.catalog_ttl_s
        if stale or not any(c in self._models for c in candidates):
            self._models, self._loaded_at = await served_models(self.redis), time.monotonic()
        found = {c: self._models[c] for c in candidates if c in self._models}
        if not found:  # as the admission would answer, before anything is counted or reserved
            raise RequestError(p.ErrorBody(message=f"The model '{model}' does not exist", param="model",
                                           code="model_not_found", status=404))
        return found

    def _prompt_tokens(self, message: p.GenerateRequest, model: str, info: p.ModelInfo) -> int:
        if isinstance(message.prompt, list):
            return len(message.prompt)
        ids = self.encoder.prompt_ids(message, model, info.model_dir)
        if ids is not None:
            return len(ids)
        # No tokenizer here (or it refuses the prompt): one token per UTF-8 byte, the most a byte-level BPE can
        # make of a text (a characters-based guess lets emoji or CJK prompts reserve a tenth of what they cost).
        if message.kind == "completion":
            return len((message.prompt or "").encode())
        return TEMPLATE_TOKENS + sum(len(f"{m.get('role', '')}\n{m.get('content') or ''}".encode()) + TEMPLATE_TOKENS
                                     for m in message.messages or [])


class Budgets:
    """The gateway's side: a limited key's request is estimated, then admitted (counted and its cost reserved)
    or refused, before it is queued. `clock` is injectable for tests."""

    def __init__(self, redis: aioredis.Redis, estimator: Estimator, request_timeout_s: float, clock=time.time):
        self.redis, self.estimator, self.clock = redis, estimator, clock
        self.hold_s = request_timeout_s + RESERVATION_MARGIN_S

    async def admit(self, api_key: ApiKey, message: p.GenerateRequest) -> Estimate:
        estimate = await self.estimator.estimate(message)
        await reserve(self.redis, api_key, message.request_id, estimate, self.clock(), self.hold_s)
        return estimate

    async def release(self, request_id: str) -> float:
        return await release(self.redis, request_id)
