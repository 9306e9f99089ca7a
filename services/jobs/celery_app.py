"""The app object Celery's own command line imports, built from the environment (REDIS_URL, TOKENFLEET_* and
DATABASE_URL) at import time, e.g.

    celery -A services.jobs.celery_app worker --pool=solo -Q tokenfleet-rollups,tokenfleet-batch -B
    celery -A services.jobs.celery_app inspect active

It is the only module-level app, and only this command line needs it: code starts a worker with
`services.jobs.tasks.run_worker` and never imports this module."""

from services.base.settings import AccountingSettings, RedisSettings
from services.jobs.tasks import celery_app

_redis_url = RedisSettings().redis_url
if not _redis_url:
    raise RuntimeError("REDIS_URL is not set: Celery's command line needs the Redis the stack runs on")

app = celery_app(AccountingSettings(), _redis_url)
