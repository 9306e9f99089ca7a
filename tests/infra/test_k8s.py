"""The Kubernetes manifests (infra/k8s): every object of each overlay passes the Kubernetes API's schemas, and
what the manifests name (settings, routes, streams, the autoscaler's metric) is what the stack really has."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import kubernetes_validate
import pytest
from pydantic_settings import BaseSettings

from services.base import protocol as p
from services.base import settings as settings_module
from tests.k8s_manifests import K8S, containers, desired_workers, find, render

KUBERNETES = "1.31.0"  # the oldest release the manifests promise to work on
OVERLAYS = ["cpu", "gpu"]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> list[dict]:
    return render(K8S / "overlays" / request.param)


def _config(objects: list[dict]) -> dict[str, str]:
    return find(objects, "ConfigMap", "tokenfleet-config")[0]["data"]


def test_every_object_passes_the_kubernetes_schemas(rendered):
    for obj in rendered:
        if obj["apiVersion"].startswith("keda.sh/"):
            continue  # a CRD: checked field by field below
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
    assert {o["kind"] for o in rendered} >= {"Namespace", "ConfigMap", "Deployment", "Service",
                                             "HorizontalPodAutoscaler", "PodDisruptionBudget", "ScaledObject"}


def test_the_worker_autoscaler_reads_the_streams_and_the_load_the_stack_has(rendered):
    [scaled] = find(rendered, "ScaledObject")
    [worker] = find(rendered, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    config = _config(rendered)
    model = config["TOKENFLEET_WORKER_MODEL"]
    assert worker["spec"]["template"]["metadata"]["labels"]["tokenfleet.dev/model"] == model
    triggers = {t["type"]: t["metadata"] for t in scaled["spec"]["triggers"]}
    assert (triggers["redis-streams"]["stream"], triggers["redis-streams"]["consumerGroup"]) == (
        p.work_stream(model), p.WORKER_GROUP)
    url = urlparse(triggers["metrics-api"]["url"])
    [gateway_service] = find(rendered, "Service", "gateway")
    assert url.hostname == f"gateway.{gateway_service['metadata']['namespace']}.svc" and url.path == "/load"
    assert parse_qs(url.query) == {"model": [model]} and triggers["metrics-api"]["valueLocation"] == "in_flight"
    # a new worker is asked for before the running ones are full
    assert float(triggers["metrics-api"]["targetValue"]) < int(config["TOKENFLEET_WORKER_MAX_NUM_SEQS"])


def test_keda_asks_for_workers_in_proportion_to_the_load_within_its_bounds(rendered):
    [scaled] = find(rendered, "ScaledObject")
    target, most = int(scaled["spec"]["triggers"][0]["metadata"]["targetValue"]), scaled["spec"]["maxReplicaCount"]
    assert desired_workers(scaled, 0) == scaled["spec"]["minReplicaCount"] == 1
    assert desired_workers(scaled, target) == 1 and desired_workers(scaled, target + 1) == 2
    assert desired_workers(scaled, 10 * most * target) == most
    assert desired_workers({"spec": {**scaled["spec"], "minReplicaCount": 0}}, 0, lag=1) == 1  # woken from zero


def test_gpu_workers_take_one_gpu_each_and_cpu_workers_none():
    for overlay, gpus in (("gpu", 1), ("cpu", None)):
        [worker] = [o for o in find(render(K8S / "overlays" / overlay), "Deployment")
                    if o["metadata"]["name"].startswith("worker-")]
        [container] = containers(worker)
        resources = container["resources"]
        assert resources["limits"].get("nvidia.com/gpu") == gpus
        assert {e["name"]: e["value"] for e in container["env"]}["TOKENFLEET_WORKER_DEVICE"] == (
            "cuda" if gpus else "cpu")
        assert container["image"].endswith("-cuda" if gpus else "-cpu")


def _settings_variables() -> set[str]:
    names = set()
    for cls in vars(settings_module).values():
        if isinstance(cls, type) and issubclass(cls, BaseSettings) and cls is not BaseSettings:
            prefix = cls.model_config.get("env_prefix", "")
            for name, field in cls.model_fields.items():
                names.add((prefix + name).upper())
                aliases = getattr(field.validation_alias, "choices", None) or []
                names |= {alias.upper() for alias in aliases if isinstance(alias, str)}
    return names


def test_every_setting_the_manifests_set_is_one_the_services_read(rendered):
    # and those read straight from the environment: settings.cache_dir(), OpenTelemetry's, torch's
    known = _settings_variables() | {"TOKENFLEET_CACHE_DIR", "OTEL_EXPORTER_OTLP_ENDPOINT", "OMP_NUM_THREADS"}
    set_here = set(_config(rendered))
    for deployment in find(rendered, "Deployment"):
        set_here |= {e["name"] for c in containers(deployment) for e in c.get("env", [])}
    assert set_here - known == set()


def test_probes_ask_routes_the_services_serve(rendered):
    from gateway.app import create_app
    from services.accounting.api import create_finance_app
    from services.base.redis_client import connect
    from services.base.settings import GatewaySettings, RouterSettings, StreamSettings

    redis = connect("redis://127.0.0.1:1/0")  # never used: the apps are only listed
    served = {"gateway": {r.path for r in create_app(redis, GatewaySettings(), RouterSettings(),
                                                     StreamSettings()).routes},
              "accounting": {r.path for r in create_finance_app(None, redis).routes},
              "worker": {"/metrics"}}
    for deployment in find(rendered, "Deployment"):
        for container in containers(deployment):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if path := container.get(probe, {}).get("httpGet", {}).get("path"):
                    assert path in served[container["name"]], (deployment["metadata"]["name"], probe, path)
    assert all(c.get("livenessProbe") for name in ("gateway", "router", "accounting", "worker-smollm2")
               for c in containers(find(rendered, "Deployment", name)[0]))
