"""The ledger's database: PostgreSQL when DATABASE_URL points to one (docker compose does), else an embedded
SQLite file; the same Alembic migrations build both."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event

MIGRATIONS = Path(__file__).with_name("migrations")


def normalize_url(url: str) -> str:
    """`postgresql://` and `postgres://` as most tools write them, with the psycopg 3 driver we install."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def sqlite_url(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path}"


def connect(url: str) -> Engine:
    engine = create_engine(normalize_url(url), pool_pre_ping=True)
    if engine.dialect.name == "sqlite":  # the consumer writes while the API reads: WAL lets both proceed
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def migrate(engine: Engine) -> None:
    """Brings the schema to the latest migration (idempotent)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")
