"""Alembic environment: run against the connection `services.accounting.db.migrate` passes in, or against
`sqlalchemy.url` when run from the `alembic` command line."""

from alembic import context
from sqlalchemy import create_engine

from services.accounting.models import Base

config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        with create_engine(config.get_main_option("sqlalchemy.url")).begin() as connection:
            _migrate(connection)
    else:
        _migrate(connection)


def _migrate(connection) -> None:
    context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


run()
