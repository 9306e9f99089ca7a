"""The ledger's tables (SQLAlchemy 2.x). One slim row per task: ids, numbers and short strings only, no
repeated request or response JSON (LiteLLM's spend logs grew mostly by that)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Index, Integer, Numeric, String, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# USD with 12 decimals: a single cached token of a small model costs ~1e-9 USD.
Money = Numeric(20, 12)


class Base(DeclarativeBase):
    pass


class LedgerRow(Base):
    __tablename__ = "ledger"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64), unique=True)  # a replayed event adds no second row
    tenant: Mapped[str] = mapped_column(String(128))
    api_key_id: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(128))
    tier: Mapped[str | None] = mapped_column(String(32))
    worker_id: Mapped[str | None] = mapped_column(String(128))
    worker_class: Mapped[str | None] = mapped_column(String(32))
    routing_reason: Mapped[str | None] = mapped_column(String(256))
    cache_result: Mapped[str] = mapped_column(String(16))  # none / prefix / exact / semantic
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    draft_tokens: Mapped[int] = mapped_column(Integer, server_default="0")  # speculative guesses scored
    accepted_draft_tokens: Mapped[int] = mapped_column(Integer, server_default="0")  # of those, kept
    queue_s: Mapped[float] = mapped_column(Float)
    ttft_s: Mapped[float] = mapped_column(Float)
    tpot_s: Mapped[float] = mapped_column(Float)
    e2e_s: Mapped[float] = mapped_column(Float)
    gpu_seconds: Mapped[float] = mapped_column(Float)  # the task's share of its worker's measured step time
    list_cost_usd: Mapped[Decimal] = mapped_column(Money)
    measured_cost_usd: Mapped[Decimal] = mapped_column(Money)
    sla_class: Mapped[str] = mapped_column(String(32))
    sla_met: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(16))  # ok / error / cancelled / expired / dead-lettered / rejected
    enqueued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_ledger_tenant_finished", "tenant", "finished_at"),
        Index("ix_ledger_model_finished", "model", "finished_at"),
        Index("ix_ledger_finished", "finished_at"),
    )


class LedgerRollup(Base):
    """The ledger summed per hour or day (UTC), tenant and model: what reports over long windows read, and what
    remains once retention has pruned the raw rows. Written only by `services.accounting.rollups`."""

    __tablename__ = "ledger_rollups"

    period: Mapped[str] = mapped_column(String(8), primary_key=True)  # hour / day
    bucket_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    tasks: Mapped[int] = mapped_column(Integer)  # those the SLA counts: all but the rejected
    ok_tasks: Mapped[int] = mapped_column(Integer)
    rejected: Mapped[int] = mapped_column(Integer, server_default="0")  # tasks refused for the client's own fault
    # A day of one busy tenant can pass 2^31 tokens
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    draft_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    accepted_draft_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    list_cost_usd: Mapped[Decimal] = mapped_column(Money)
    measured_cost_usd: Mapped[Decimal] = mapped_column(Money)
    sla_met: Mapped[int] = mapped_column(Integer)
    attainment: Mapped[float] = mapped_column(Float)  # sla_met / tasks
    goodput: Mapped[float] = mapped_column(Float)  # sla_met per second of the bucket
    # Latency percentiles of the ok tasks; None when the bucket has none
    ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    ttft_p95_s: Mapped[float | None] = mapped_column(Float)
    ttft_p99_s: Mapped[float | None] = mapped_column(Float)
    tpot_p50_s: Mapped[float | None] = mapped_column(Float)
    tpot_p95_s: Mapped[float | None] = mapped_column(Float)
    tpot_p99_s: Mapped[float | None] = mapped_column(Float)
    # Set once retention deleted the raw rows behind these figures: a re-roll (which would see none of them)
    # must then leave the figures alone.
    raw_pruned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    rolled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_ledger_rollups_tenant", "period", "tenant", "bucket_start"),)
