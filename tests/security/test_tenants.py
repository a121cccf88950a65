"""What one tenant can learn of another's prompts through shared state: nothing. Sessions,
the prefix cache (and so the KV store, keyed by the same block hashes) and the response cache
are per tenant; a leading system message sent with `share_system_prompt` is the one thing
tenants share, on purpose. Against real keyed processes, through the instance and the gateway."""

from __future__ import annotations

import httpx
import pytest
from sim_stack import ADMIN_KEY, CLIENT_KEY, MODEL, OTHER_CLIENT_KEY, Targets

from strata.gateway.path.response_cache import cache_key
from strata.protocol.auth import tenant_of_key

SYSTEM = " ".join(f"rule{i}" for i in range(24))  # several 16-token blocks of its own


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(url: str, key: str, question: str, *, share: bool = False,
         session: str | None = None, topic: str = "sessions") -> httpx.Response:
    """`topic` starts the system prompt: each test's prompts share no block with another's."""
    body = {"model": MODEL, "max_tokens": 2, "share_system_prompt": share,
            "messages": [{"role": "system", "content": f"{topic} {SYSTEM}"},
                         {"role": "user", "content": question}]}
    headers = auth(key) | ({"X-Session-Id": session} if session else {})
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=15)


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("target", ["instance", "gateway"])
def test_a_session_of_one_tenant_is_invisible_to_another(keyed: Targets, target: str) -> None:
    url, name = keyed.urls[target], f"shared-name-{target}"
    assert chat(url, CLIENT_KEY, "first question", session=name).status_code == 200
    mine = httpx.get(f"{url}/v1/sessions/{name}", headers=auth(CLIENT_KEY), timeout=10)
    assert mine.status_code == 200 and mine.json()["num_messages"] == 3
    for method in ("GET", "DELETE"):
        theirs = httpx.request(method, f"{url}/v1/sessions/{name}",
                               headers=auth(OTHER_CLIENT_KEY), timeout=10)
        assert theirs.status_code == 404  # exactly as for an id nobody uses
    listed = httpx.get(f"{url}/v1/sessions", headers=auth(OTHER_CLIENT_KEY), timeout=10)
    assert name not in [s["id"] for s in listed.json()["data"]]
    # the other tenant's turn under the same name starts its own session
    assert chat(url, OTHER_CLIENT_KEY, "another question", session=name).status_code == 200
    again = httpx.get(f"{url}/v1/sessions/{name}", headers=auth(CLIENT_KEY), timeout=10)
    assert again.json()["num_messages"] == 3
    assert again.json()["messages"][1]["content"] == "first question"


def test_a_tenant_never_hits_another_tenants_prefix_cache(keyed: Targets) -> None:
    url = keyed.instance.url
    question = "what is the secret plan " * 2
    def ask(key: str) -> int:
        return cached_tokens(chat(url, key, question, topic="private"))

    assert ask(CLIENT_KEY) == 0
    assert ask(CLIENT_KEY) > 0  # the same tenant hits its own blocks ...
    assert ask(OTHER_CLIENT_KEY) == 0  # ... another tenant not
    assert ask(ADMIN_KEY) == 0  # nor the operator


def test_a_shared_system_prompt_is_the_only_thing_tenants_share(keyed: Targets) -> None:
    url = keyed.instance.url
    def ask(key: str, question: str, share: bool = True) -> int:
        return cached_tokens(chat(url, key, question, share=share, topic="public"))

    assert ask(CLIENT_KEY, "a private question " * 3) == 0
    theirs = ask(OTHER_CLIENT_KEY, "a private question " * 3)
    assert theirs > 0  # the public system prompt's blocks ...
    repeat = ask(OTHER_CLIENT_KEY, "a private question " * 3)
    assert repeat > theirs  # ... and not the other tenant's question, only its own
    # without the opt-in, even the system prompt is the tenant's own
    assert ask(OTHER_CLIENT_KEY, "a new question " * 3, share=False) == 0


def test_response_cache_keys_carry_the_tenant() -> None:
    body = {"model": "m", "prompt": "p", "temperature": 0}
    keys = {cache_key("/v1/completions", body, model="m", version="1", tenant=t)
            for t in ("", tenant_of_key(CLIENT_KEY), tenant_of_key(OTHER_CLIENT_KEY))}
    assert len(keys) == 3 and None not in keys
    assert cache_key("/v1/completions", body, model="m", version="1") == \
        cache_key("/v1/completions", body, model="m", version="1", tenant="")
