"""Tenants share a fleet but not what their prompts begin with: the prefix cache is salted per tenant at the
gateway (an admin may group keys to share one), so neither `cached_tokens` nor the time to first token tells
one tenant what another has sent."""

from __future__ import annotations

import time
import uuid

import openai

from tests.stack import MODEL


def _cached_tokens(client: openai.OpenAI, system: str, **kwargs) -> int:
    reply = client.chat.completions.create(model=MODEL, max_tokens=2, **kwargs,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": "Hi"}])
    return reply.usage.prompt_tokens_details.cached_tokens


def _seen(client: openai.OpenAI, system: str) -> None:
    """Until one of the two workers reports the prompt's prefix cached for this client's key."""
    assert max(_cached_tokens(client, system) for _ in range(3)) >= 64


def test_another_tenant_gets_no_cached_tokens_for_a_prompt_it_never_sent(stack):
    system = f"Tenant A's confidential instructions {uuid.uuid4().hex}. " * 20
    _seen(stack.key_client(f"iso-a-{uuid.uuid4().hex[:6]}"), system)
    time.sleep(1.0)  # workers publish prefix-cache changes with their heartbeat: the router knows who holds it
    for _ in range(2):  # each a new tenant: a tenant's second request would hit its own first
        assert _cached_tokens(stack.key_client(f"iso-b-{uuid.uuid4().hex[:6]}"), system) == 0


def test_a_client_cache_salt_cannot_reach_another_tenants_prefixes(stack):
    system = f"Shared-looking instructions {uuid.uuid4().hex}. " * 20
    tenant_a, tenant_b = stack.key_client(f"iso-a-{uuid.uuid4().hex[:6]}"), stack.key_client(
        f"iso-b-{uuid.uuid4().hex[:6]}")
    assert max(_cached_tokens(tenant_a, system, extra_body={"cache_salt": "s"}) for _ in range(3)) >= 64
    assert _cached_tokens(tenant_b, system, extra_body={"cache_salt": "s"}) == 0


def test_keys_an_admin_put_in_one_prefix_group_share_cached_prefixes(stack):
    group, system = uuid.uuid4().hex, f"One product's system prompt {uuid.uuid4().hex}. " * 20
    first = stack.key_client(f"grp-a-{group[:6]}", prefix_group=group)
    second = stack.key_client(f"grp-b-{group[:6]}", prefix_group=group)
    _seen(first, system)
    time.sleep(1.0)  # workers publish prefix-cache changes with their heartbeat
    # The router looks the prefix up under the same salt, so it sends the second key to the worker holding it.
    assert _cached_tokens(second, system) >= 64


def test_an_idempotency_key_replays_only_to_the_tenant_that_used_it(stack):
    key = f"idem-{uuid.uuid4().hex}"
    tenant_a, tenant_b = stack.key_client(f"iso-a-{uuid.uuid4().hex[:6]}"), stack.key_client(
        f"iso-b-{uuid.uuid4().hex[:6]}")

    def ask(client: openai.OpenAI, content: str):
        return client.chat.completions.create(model=MODEL, max_tokens=4, extra_headers={"Idempotency-Key": key},
                                              messages=[{"role": "user", "content": content}])

    first = ask(tenant_a, "Tenant A's private question")
    assert ask(tenant_a, "Tenant A's private question").id == first.id  # a replay, for A itself
    other = ask(tenant_b, "Tenant B's own question, a good deal longer than A's and about something else")
    assert other.id != first.id and other.usage.prompt_tokens != first.usage.prompt_tokens
