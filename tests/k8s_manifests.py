"""The Kubernetes manifests (infra/k8s) as a cluster would receive them, and the replica count KEDA computes from
their ScaledObject: shared by the manifest tests and the test that feeds the autoscaler real load figures.

`render` uses `kustomize build` or `kubectl kustomize` where one is installed; otherwise it applies the part of
Kustomize the manifests use (resources, namespace, labels, images, JSON 6902 patches), which the manifest tests
hold them to."""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import jsonpatch
import yaml

K8S = Path(__file__).resolve().parents[1] / "infra" / "k8s"
CLUSTER_SCOPED = {"Namespace"}


def render(directory: Path) -> list[dict]:
    if tool := shutil.which("kustomize"):
        return list(yaml.safe_load_all(subprocess.run([tool, "build", str(directory)], check=True,
                                                      capture_output=True, text=True).stdout))
    if tool := shutil.which("kubectl"):
        return list(yaml.safe_load_all(subprocess.run([tool, "kustomize", str(directory)], check=True,
                                                      capture_output=True, text=True).stdout))
    return _build(directory)


def _build(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "labels", "resources", "images", "patches"}
    unknown = set(kustomization) - known
    assert not unknown, f"{directory}: fields this renderer does not apply: {unknown}"
    objects = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        objects += _build(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"{directory}: patch target {target} matches {len(matches)} objects"
        index = objects.index(matches[0])
        objects[index] = jsonpatch.apply_patch(matches[0], yaml.safe_load(patch["patch"]))
    for obj in objects:
        if "namespace" in kustomization and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kustomization["namespace"]
        for group in kustomization.get("labels", []):
            obj["metadata"].setdefault("labels", {}).update(group["pairs"])
        for image in kustomization.get("images", []):
            for container in containers(obj):
                if container["image"].split(":")[0] == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return objects


def containers(obj: dict) -> list[dict]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def desired_workers(scaled_object: dict, in_flight: int, lag: int = 0) -> int:
    """KEDA's replica count: per trigger ceil(value / target) (its AverageValue metrics, as the HPA computes
    them), the largest of them, within [minReplicaCount, maxReplicaCount]; an activation threshold (redis-streams'
    activationLagCount) wakes a deployment scaled to zero once exceeded."""
    spec = scaled_object["spec"]
    wanted = 0
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        if trigger["type"] == "metrics-api":
            wanted = max(wanted, math.ceil(in_flight / float(meta["targetValue"])))
        elif trigger["type"] == "redis-streams":
            wanted = max(wanted, math.ceil(lag / float(meta["lagCount"])))
            if lag > int(meta.get("activationLagCount", 0)):
                wanted = max(wanted, 1)
    return min(spec.get("maxReplicaCount", 100), max(spec.get("minReplicaCount", 0), wanted))
