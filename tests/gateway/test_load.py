"""The gateway's `GET /load`, the figure KEDA scales workers on (infra/k8s): a model's requests in flight, which
rises with real concurrent traffic and falls back when it ends, fed to the manifests' own scaling rule."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.k8s_manifests import K8S, desired_workers, find, render
from tests.stack import MODEL

CONCURRENT = 12


def _load(stack, model: str = MODEL) -> httpx.Response:
    return httpx.get(stack.url + "/load", params={"model": model}, timeout=10)


def test_load_counts_a_models_requests_in_flight_and_the_scaling_rule_follows_it(stack):
    client = stack.client(max_retries=0)
    assert _load(stack).json()["in_flight"] == 0 and _load(stack).json()["workers"] >= 1
    depths, done = [], threading.Event()

    def record() -> None:  # what KEDA's poll would read, sampled as the burst runs
        while not done.is_set():
            depths.append(_load(stack).json()["in_flight"])
            time.sleep(0.05)

    recorder = threading.Thread(target=record)
    recorder.start()
    with ThreadPoolExecutor(CONCURRENT) as pool:
        list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=f"Load {i}:", max_tokens=96,
                                                          extra_body={"ignore_eos": True}), range(CONCURRENT)))
    done.set()
    recorder.join()
    assert max(depths) == CONCURRENT and _load(stack).json()["in_flight"] == 0

    [scaled] = find(render(K8S / "base"), "ScaledObject")
    busy = copy.deepcopy(scaled)  # as if each worker took 4 requests: the burst needs 3
    busy["spec"]["triggers"][0]["metadata"]["targetValue"] = "4"
    assert [desired_workers(busy, d) for d in (0, max(depths))] == [1, 3]
    assert desired_workers(scaled, max(depths)) == 1  # within one worker's target as shipped


def test_load_of_an_unknown_model_is_a_404_error_object_and_a_missing_model_a_400(stack):
    unknown = _load(stack, "no-such-model")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    missing = httpx.get(stack.url + "/load", timeout=10)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
