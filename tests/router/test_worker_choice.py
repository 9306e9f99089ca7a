"""Worker choice within a tier: the cached prefix draws a request while the holder's extra load is worth
less than the prefix; a flood of one prefix spills over; ties are consistent."""

from __future__ import annotations

from router.worker_choice import WorkerChooser, WorkerLoad

CHOOSER = WorkerChooser(min_prefix_tokens=64, load_cost_tokens=256)


def _workers(**loads: int) -> list[WorkerLoad]:
    return [WorkerLoad(name, load) for name, load in loads.items()]


def test_a_request_goes_to_the_worker_holding_its_long_prefix_while_loads_are_level():
    choice = CHOOSER.choose(_workers(a=2, b=2), {"b": 1504}, affinity_key=7)
    assert choice.worker_id == "b" and choice.cached_tokens == 1504 and "prefix 1504" in choice.reason


def test_a_prefix_shorter_than_the_minimum_counts_for_nothing():
    assert CHOOSER.choose(_workers(a=0, b=1), {"b": 48}, affinity_key=7).worker_id == "a"


def test_a_flood_of_one_prefix_spills_to_the_other_worker_once_load_outweighs_the_cache():
    cached = {"a": 1504}  # 1504 tokens are worth 5.9 requests of queue at 256 tokens each
    loads, sent = {"a": 0, "b": 0}, []
    for _ in range(20):
        choice = CHOOSER.choose(_workers(**loads), cached, affinity_key=7)
        loads[choice.worker_id] += 1
        sent.append(choice.worker_id)
    assert sent[:6] == ["a"] * 6  # the holder takes the first ones
    assert "b" in sent and loads["a"] - loads["b"] <= 6  # then the excess spreads


def test_once_both_hold_the_prefix_the_less_loaded_one_serves():
    assert CHOOSER.choose(_workers(a=3, b=1), {"a": 1504, "b": 1504}, affinity_key=7).worker_id == "b"


def test_without_any_cache_the_least_loaded_worker_serves():
    assert CHOOSER.choose(_workers(a=4, b=1, c=2), {}, affinity_key=7).worker_id == "b"


def test_a_new_prefix_lands_on_the_same_worker_every_time_among_equals():
    workers = _workers(a=0, b=0, c=0, d=0)
    picks = {key: CHOOSER.choose(workers, {}, affinity_key=key).worker_id for key in range(64)}
    assert all(CHOOSER.choose(workers, {}, affinity_key=k).worker_id == w for k, w in picks.items())
    assert len(set(picks.values())) == 4  # and different prefixes spread over the workers
