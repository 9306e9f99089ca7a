"""A migrated, empty ledger database per test (PostgreSQL at DATABASE_URL, else SQLite)."""

from __future__ import annotations

import pytest

from services.accounting import db


@pytest.fixture
def ledger_engine(new_database):
    engine = db.connect(new_database())
    db.migrate(engine)
    yield engine
    engine.dispose()
