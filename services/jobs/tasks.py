"""The ledger's background jobs on Celery, with Redis (REDIS_URL) as the broker: rollups of recent buckets every
few minutes, retention daily and the batch sweep (batch_lease.py) every half minute, all sent by Celery beat; and
the Batch API's jobs, sent by the gateway. The jobs are idempotent (see `rollups`, `batch_jobs`), so a job run
twice, or redelivered after a worker died mid-run, does no harm.

Redis keys: Celery's Redis transport keeps its own keys (a list per queue, `_kombu.binding.*` sets, the
`unacked` hash and index, pub/sub channels for remote control). All of them carry the prefix `KEY_PREFIX`
(kombu's `global_keyprefix`) instead of living in another DB number: the stack's own keys never start with it,
and a prefix also works where only DB 0 exists (Redis Cluster, many managed Redis services) and on the embedded
server's unix socket. `SCAN MATCH tokenfleet-celery:*` lists them all.

No result backend: what a job produces is rows in the ledger database; its return value is only logged.

Celery's command line needs an importable app object; that lives in `services.jobs.celery_app`, the only
module-level app. Code starts a worker with `run_worker`."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from celery import Celery, signals
from celery.schedules import crontab
from kombu import Queue
from sqlalchemy import Engine

from services.accounting import db, rollups
from services.base.redis_client import UNREACHABLE, connect
from services.base.settings import AccountingSettings

# The queue names, here only. A worker consumes them in this order (kombu's "priority" strategy, not round
# robin), so pending rollups go before pending batch jobs; a job already running is not interrupted, so long
# batch jobs (RUN_BATCH, the Batch API's) want a worker of their own: `-Q tokenfleet-batch`.
QUEUE_ROLLUPS = "tokenfleet-rollups"  # the scheduled ledger jobs: short and frequent
QUEUE_BATCH = "tokenfleet-batch"  # low priority: later batch jobs, and any task not routed elsewhere
QUEUES = (QUEUE_ROLLUPS, QUEUE_BATCH)
KEY_PREFIX = "tokenfleet-celery:"

ROLLUP_RECENT = "tokenfleet.accounting.rollup_recent"
APPLY_RETENTION = "tokenfleet.accounting.apply_retention"
RUN_BATCH = "tokenfleet.accounting.run_batch"  # sent by the gateway, by name (services/batch/store.py)
SWEEP_BATCHES = "tokenfleet.accounting.sweep_batches"
RETENTION_AT = crontab(hour=3, minute=30)  # daily, at a quiet hour (UTC)
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

log = logging.getLogger(__name__)


def broker_url(redis_url: str) -> str:
    """REDIS_URL as kombu reads it: redis-py's `unix:///path.sock` (the embedded server's) is kombu's
    `redis+socket:///path.sock`; redis:// and rediss:// URLs are the same in both."""
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url[len("unix://"):]
    return redis_url


def celery_app(settings: AccountingSettings, redis_url: str, *, key_prefix: str = KEY_PREFIX) -> Celery:
    """A Celery app with the ledger's tasks (`app.tasks[ROLLUP_RECENT]`, `app.tasks[APPLY_RETENTION]`) and their
    beat schedule. `key_prefix` is for tests sharing one Redis; everything else keeps the default."""
    app = Celery("tokenfleet-accounting", broker=broker_url(redis_url), set_as_current=False)
    app.conf.update(
        broker_transport_options={"global_keyprefix": key_prefix, "queue_order_strategy": "priority"},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue=QUEUE_BATCH,
        task_routes={ROLLUP_RECENT: {"queue": QUEUE_ROLLUPS}, APPLY_RETENTION: {"queue": QUEUE_ROLLUPS},
                     SWEEP_BATCHES: {"queue": QUEUE_ROLLUPS}, RUN_BATCH: {"queue": QUEUE_BATCH}},
        task_ignore_result=True,
        # Acknowledged when done, not when received: a job whose worker died is redelivered (after the
        # transport's visibility timeout, 1 h), which idempotent jobs allow. A batch job that died is sent
        # again sooner, by the batch sweep (batch_lease.py).
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        timezone="UTC",
        enable_utc=True,
        # Beat keeps its schedule in memory, not in a shelve file in the working directory: a missed rollup is
        # made up by the next one, a missed retention run by the next day's.
        beat_scheduler="celery.beat:Scheduler",
        beat_schedule={
            "ledger-rollups": {"task": ROLLUP_RECENT, "schedule": settings.rollup_interval_s,
                               # a rollup that waited longer than that is superseded by the next one
                               "options": {"expires": settings.rollup_interval_s}},
            "ledger-retention": {"task": APPLY_RETENTION, "schedule": RETENTION_AT},
            "batch-sweep": {"task": SWEEP_BATCHES, "schedule": settings.batch_sweep_interval_s,
                            "options": {"expires": settings.batch_sweep_interval_s}},
        },
    )

    @functools.cache
    def ledger() -> Engine:
        # Opened on first use, in the process that runs the job (after any fork); migrating is idempotent and
        # lets a worker start before the accounting service ever ran.
        engine = db.connect(settings.ledger_url())
        db.migrate(engine)
        return engine

    # shared=False: Celery would otherwise register the task with every app created afterwards, and each app
    # (its own settings, its own database) would run the first app's closure.
    @app.task(name=ROLLUP_RECENT, shared=False)
    def rollup_recent(hours: float | None = None) -> int:
        """Re-rolls the hour and day buckets of the last `hours` (default: rollup_lookback_hours), so that
        events recorded late are counted; returns the rollup rows written."""
        return rollups.roll_up_recent(ledger(), settings.rollup_lookback_hours if hours is None else hours)

    @app.task(name=APPLY_RETENTION, shared=False)
    def apply_retention() -> int:
        """Deletes raw ledger rows older than retention_days (whole days, once rolled up); returns rows deleted."""
        if settings.retention_days <= 0:
            return 0
        return rollups.roll_up_and_prune(ledger(), datetime.now(UTC) - timedelta(days=settings.retention_days))

    @app.task(name=RUN_BATCH, shared=False)
    def run_batch(batch_id: str) -> dict:
        """Runs a Batch API batch's lines through the stack; returns its request counts. Idempotent: a re-run
        skips the lines already answered."""
        # Imported here: the job needs the gateway's request schemas, which the ledger's jobs do not.
        from services.batch import runner as batch_jobs

        return batch_jobs.run_batch(redis_url, batch_id, lease_s=settings.batch_lease_s)

    @app.task(name=SWEEP_BATCHES, shared=False)
    def sweep_batches() -> list[str]:
        """Sends a job again for each started batch whose job died; returns their ids."""
        from services.batch import lease as batch_lease

        def submit(batch_id: str) -> None:
            app.send_task(RUN_BATCH, args=[batch_id], queue=QUEUE_BATCH)

        async def main() -> list[str]:
            redis = connect(redis_url)
            try:
                return await batch_lease.sweep(redis, submit, settings.batch_requeue_after_s)
            except UNREACHABLE as exc:  # the next sweep looks again: a line, not a failed task's traceback
                log.warning("batch sweep skipped: Redis unreachable (%s)", exc)
                return []
            finally:
                await redis.aclose()

        return asyncio.run(main())

    return app


def worker_argv(beat: bool = True, loglevel: str = "INFO") -> list[str]:
    """`celery worker` arguments: one job at a time in the worker's own process (the jobs are database-bound and
    short; no pool of forked children to manage), consuming both queues, optionally with beat embedded (a
    child process sending the schedule). Gossip, mingle and heartbeats coordinate worker clusters and feed
    monitors; one worker needs none of them."""
    argv = ["worker", "--pool=solo", "--concurrency=1", f"--queues={','.join(QUEUES)}", f"--loglevel={loglevel}",
            "--hostname=tokenfleet-accounting@%h", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    return [*argv, "--beat"] if beat else argv


def run_worker(settings: AccountingSettings, redis_url: str, *, beat: bool = True, key_prefix: str = KEY_PREFIX,
               loglevel: str = "INFO") -> int:
    """Runs a Celery worker (with beat embedded unless `beat=False`) until SIGTERM or SIGINT, which let the
    running job finish; returns the exit status. Blocks, and installs signal handlers: call it from the main
    thread of a process of its own (a `tokenfleet celery` command)."""
    app = celery_app(settings, redis_url, key_prefix=key_prefix)
    worker_pid = os.getpid()

    def end_with_the_worker(**_) -> None:
        # The embedded beat is a child process, and outlived a worker killed with SIGKILL (or by the OOM killer):
        # each restart of the worker left one more beat sending the schedule. The kernel ends it with its parent.
        if sys.platform == "linux":
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != worker_pid:  # the worker died before the line above
                os._exit(0)

    signals.beat_init.connect(end_with_the_worker, weak=False)
    return app.start(worker_argv(beat, loglevel)) or 0


def celery_submitter(redis_url: str) -> Callable[[str], Awaitable[None]]:
    """Sends a batch to the accounting service's Celery workers, on their low-priority batch queue, by task name.
    Celery rather than a queue of our own: the job then has what the ledger's jobs have (acknowledged only when
    done, so a job whose worker died is redelivered, which the job's idempotence allows; one worker fleet and one
    way to run and watch background jobs), and the gateway needs no code of the job, only its name."""
    app = celery_app(AccountingSettings(), redis_url)

    async def submit(batch_id: str) -> None:
        # send_task blocks on the broker: off the event loop
        await asyncio.to_thread(app.send_task, RUN_BATCH, args=[batch_id], queue=QUEUE_BATCH)

    return submit
