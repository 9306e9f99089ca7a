"""model="auto": the size rule picks a tier, and a tier with no live worker is passed over."""

from router.policy import TierRule, route
from services.base import protocol as p

RULE = TierRule("small", "large", max_prompt_tokens=100, max_tokens=50)


def _request(model: str, max_tokens: int | None) -> p.GenerateRequest:
    return p.GenerateRequest(request_id="r", kind="completion", model=model, prompt="x",
                             sampling=p.SamplingOptions(max_tokens=max_tokens))


def test_short_prompt_and_short_output_go_to_the_small_tier():
    assert route(_request("auto", 20), RULE, 80, {"small", "large"})[0] == "small"


def test_long_prompt_or_long_or_unbounded_output_go_to_the_large_tier():
    assert route(_request("auto", 20), RULE, 101, {"small", "large"})[0] == "large"
    assert route(_request("auto", 51), RULE, 10, {"small", "large"})[0] == "large"
    assert route(_request("auto", None), RULE, 10, {"small", "large"})[0] == "large"


def test_auto_falls_back_to_the_tier_that_has_a_live_worker():
    model, reason = route(_request("auto", 20), RULE, 80, {"large"})
    assert model == "large" and "no live worker" in reason


def test_a_named_model_is_kept_whatever_the_rule_says():
    assert route(_request("small", None), RULE, 10_000, set()) == ("small", "named by the request")
