"""Prefix caching over the API: usage reports cached prompt tokens, and cache_salt keeps tenants apart."""

from __future__ import annotations

import httpx


def _cached(client, prompt: str, **extra) -> int:
    r = client.completions.create(model="embedded", prompt=prompt, max_tokens=2, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


def test_a_repeated_prompt_is_served_from_the_cache_and_a_salt_is_a_tenant_of_its_own(fake_server):
    client = fake_server.client()
    prompt = "The same long system prompt, shared by many requests of one tenant. " * 2
    assert _cached(client, prompt + "first") == 0
    assert _cached(client, prompt + "second") >= 128  # every full 16-token block of the shared text
    assert _cached(client, prompt + "third", cache_salt="tenant-b") == 0  # another tenant sees nothing
    assert _cached(client, prompt + "fourth", cache_salt="tenant-b") >= 128  # but shares with itself


def test_an_empty_cache_salt_is_a_400_naming_it(fake_server):
    r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "x", "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = httpx.post(fake_server.url + "/v1/completions", json={"prompt": "x", "cache_salt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
