"""docker-compose.yml: a valid file whose tokenfleet services run real `tokenfleet` commands on the GPU they need."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"
PROMETHEUS_FILE = ROOT / "infra" / "prometheus" / "prometheus.yml"
TOKENFLEET_IMAGE = "tokenfleet"  # the image built from infra/docker/Dockerfile; its entrypoint is `tokenfleet`
TOKENFLEET_SERVICES = ["gateway", "router", "worker-small", "worker-large"]
GPU_WORKERS = ["worker-small", "worker-large"]
WORKER_DRAIN_TIMEOUT_S = 30
TOP_LEVEL_KEYS = {"services", "volumes", "networks", "configs", "secrets", "name"}


def _compose() -> dict:
    with COMPOSE_FILE.open() as f:
        return yaml.safe_load(f)


COMPOSE = _compose()
SERVICES: dict[str, dict] = COMPOSE["services"]


def _image_name(service: dict) -> str:
    """`tokenfleet` for `tokenfleet:latest` or `registry:5000/tokenfleet@sha256:…`: the repository's last part."""
    image = service.get("image", "").split("@")[0]
    last = image.rsplit("/", 1)[-1]
    return last.split(":")[0]


def _uses_tokenfleet_image(service: dict) -> bool:
    return _image_name(service) == TOKENFLEET_IMAGE


def _command(service: dict) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def _environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return {k: v for k, _, v in (item.partition("=") for item in env)}
    return {k: None if v is None else str(v) for k, v in env.items()}


def _volume_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each mount, short syntax (`models:/models:ro`) or long (`{source, target}`)."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            mounts.append((source, rest.split(":")[0]) if rest else ("", source))
        else:
            mounts.append((volume.get("source", ""), volume["target"]))
    return mounts


def _is_named_volume(source: str) -> bool:
    return bool(source) and not source.startswith((".", "/", "~", "$"))


def _seconds(duration: str | int) -> float:
    """A compose duration (`40s`, `1m30s`, `500ms`) in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def _compose_cli() -> list[str] | None:
    """`docker compose` (v2 plugin) or `docker-compose`, whichever answers `version`; None when neither does."""
    for cli in (["docker", "compose"], ["docker-compose"]):
        try:
            proc = subprocess.run([*cli, "version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.returncode == 0:
            return cli
    return None


def _config(*files: Path, **env: str) -> subprocess.CompletedProcess:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here; "
                    "test_compose_file_is_structurally_valid checks the file instead")
    unset = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_", "POSTGRES_", "TOKENFLEET_"))}
    # --env-file: the environment given here, not a developer's .env beside the file
    command = [*cli, "--env-file", os.devnull, *(arg for f in files for arg in ("-f", str(f))), "config", "-q"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**unset, **env})


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, CPU_OVERRIDE]], ids=["gpu", "cpu"])
def test_docker_compose_config_accepts_the_file(files):
    proc = _config(*files, REDIS_PASSWORD="r3dis", POSTGRES_PASSWORD="p0stgres")
    assert proc.returncode == 0, proc.stderr


def test_docker_compose_refuses_to_start_without_the_passwords():
    proc = _config(COMPOSE_FILE)
    assert proc.returncode != 0 and re.search(r"set (REDIS|POSTGRES)_PASSWORD in \.env", proc.stderr), proc.stderr


def test_compose_file_is_structurally_valid():
    unknown = {key for key in COMPOSE if key not in TOP_LEVEL_KEYS and not key.startswith("x-")}
    assert not unknown, f"unknown top-level keys: {unknown}"
    declared_volumes = set(COMPOSE.get("volumes") or {})
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, f"{name}: neither image nor build"
        if "build" in service:
            build = service["build"]
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert (context / dockerfile).is_file(), f"{name}: no {dockerfile} in {context}"
        depends_on = service.get("depends_on", [])
        missing = set(depends_on) - set(SERVICES)
        assert not missing, f"{name} depends on undefined services {missing}"
        for source, _ in _volume_mounts(service):
            if _is_named_volume(source):
                assert source in declared_volumes, f"{name}: volume {source!r} is not declared"
            elif source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: bind-mount source {source} does not exist"
        for port in service.get("ports", []):
            host = r"(\d+(-\d+)?|\$\{[A-Z_]+:-\d+\})"  # a host port, or a variable with a default
            assert isinstance(port, str) and re.fullmatch(rf"({host}:)?\d+(-\d+)?(/(tcp|udp))?", port), \
                f"{name}: port {port!r} should be a quoted string like \"8000:8000\""


@pytest.mark.parametrize("name", sorted(set(TOKENFLEET_SERVICES) | {
    name for name, service in SERVICES.items() if _uses_tokenfleet_image(service)}))
def test_tokenfleet_service_command_is_a_valid_cli_invocation(name):
    from services.launcher.cli import build_parser

    service = SERVICES.get(name)
    assert service is not None, f"docker-compose.yml has no {name} service"
    assert _uses_tokenfleet_image(service), f"{name} does not run the {TOKENFLEET_IMAGE} image"
    command = _command(service)
    assert command, f"{name} has no command (the entrypoint `tokenfleet` needs a subcommand)"
    try:
        args = build_parser().parse_args(command)
    except SystemExit as exc:
        pytest.fail(f"`tokenfleet {shlex.join(command)}` is rejected by the CLI (exit {exc.code})")
    assert args.command == command[0]


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_gpu_worker_reserves_an_nvidia_gpu_and_mounts_the_models_volume(name):
    service = SERVICES[name]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
               and (d.get("count", 0) == "all" or int(d.get("count", 0)) >= 1 or d.get("device_ids"))
               for d in devices), devices
    assert _environment(service).get("TOKENFLEET_WORKER_DEVICE") == "cuda"
    cache_dir = _environment(service).get("TOKENFLEET_CACHE_DIR")
    assert ("models", cache_dir) in _volume_mounts(service), \
        f"{name}: the models volume should be mounted at TOKENFLEET_CACHE_DIR ({cache_dir})"


@pytest.mark.parametrize("name", GPU_WORKERS)
def test_worker_gets_longer_to_stop_than_its_drain_timeout(name):
    assert SERVICES[name].get("restart") == "unless-stopped"
    assert _seconds(SERVICES[name].get("stop_grace_period", "10s")) > WORKER_DRAIN_TIMEOUT_S


def test_prometheus_scrapes_the_gateway_accounting_and_every_worker_metrics_port():
    with PROMETHEUS_FILE.open() as f:
        config = yaml.safe_load(f)
    targets = {target for job in config["scrape_configs"] for group in job.get("static_configs", [])
               for target in group["targets"]}
    gateway_command = _command(SERVICES["gateway"])
    expected = {f"gateway:{gateway_command[gateway_command.index('--port') + 1]}"}
    expected |= {f"{name}:{_environment(SERVICES[name])['TOKENFLEET_WORKER_METRICS_PORT']}" for name in GPU_WORKERS}
    expected.add(f"accounting:{_environment(SERVICES['accounting'])['TOKENFLEET_ACCOUNTING_PORT']}")
    assert expected <= targets, f"not scraped: {expected - targets}"


def test_compose_runs_redis_with_the_append_only_file():
    """What a Redis restart must not lose (queued requests, replies, unrecorded completion events) is persisted."""
    command = shlex.split(" ".join(_command(SERVICES["redis"])))  # `sh -c "exec redis-server ..."`
    assert command[command.index("--appendonly") + 1] == "yes"


ONE_SHOT = {"migrate"}  # runs to completion before the services that need it
NO_CLIENT_INSIDE = {"jaeger"}  # optional (monitoring); its image has nothing to run a check with


@pytest.mark.parametrize("name", sorted(set(SERVICES) - ONE_SHOT))
def test_every_long_running_service_has_a_healthcheck_and_rotated_logs(name):
    service = SERVICES[name]
    if name not in NO_CLIENT_INSIDE:
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    assert service.get("logging", {}).get("options", {}).get("max-size"), f"{name}'s log is not rotated"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_image_is_pinned_to_a_version(name):
    image = SERVICES[name]["image"]
    tag = image.split("@")[0].rsplit(":", 1)
    assert len(tag) == 2 and tag[1] not in ("latest", "") and "/" not in tag[1], f"{name}: {image} is not pinned"


def test_no_password_is_written_in_the_file():
    """Passwords come from .env (infra/compose.env.example), and compose refuses to start without them."""
    text = COMPOSE_FILE.read_text()
    assert not re.search(r"(?i)password\s*[:=]\s*(?!\$\{)[\w\"']", text.replace("$$REDIS_PASSWORD", ""))
    for variable in ("REDIS_PASSWORD", "POSTGRES_PASSWORD"):
        assert f"${{{variable}:?" in text and re.search(rf"^{variable}=$", (
            ROOT / "infra" / "compose.env.example").read_text(), re.M)
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_redis_refuses_writes_when_full_instead_of_evicting_queued_work_and_requires_its_password():
    command = " ".join(_command(SERVICES["redis"]))
    assert "--maxmemory-policy noeviction" in command and "--requirepass" in command
    assert _environment(SERVICES["gateway"])["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD")


def test_each_gpu_worker_is_pinned_to_its_own_gpu_by_default():
    defaults = []
    for name in GPU_WORKERS:
        [device] = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert "count" not in device, f"{name}: count and device_ids exclude each other"
        [pinned] = device["device_ids"]
        defaults.append(re.fullmatch(r"\$\{[A-Z_]+:-(\w+)\}", pinned).group(1))
    assert len(set(defaults)) == len(GPU_WORKERS), defaults


def test_the_gateway_and_router_read_the_models_volume_without_writing_it():
    for name in ("gateway", "router"):
        assert "models:/models:ro" in SERVICES[name]["volumes"], name


def test_the_ledger_is_migrated_once_before_the_services_that_use_it():
    assert _command(SERVICES["migrate"]) == ["accounting", "--migrate"]
    for name in ("accounting", "celery"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
