"""API keys on an instance: the same middleware as the gateway's, over real sockets."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL_NAME, start_server
from openai import OpenAI

from strata.model.loader import LoadedModel


def test_instance_requires_a_valid_key_and_leaves_probes_open(tiny_model: LoadedModel) -> None:
    server = start_server(tiny_model, api_keys=("secret-1", "secret-2"), rate_limit_per_s=1000.0)
    try:
        good = OpenAI(base_url=server.v1, api_key="secret-2")
        out = good.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2,
                                      extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError) as err:
            OpenAI(base_url=server.v1, api_key="wrong").models.list()
        assert err.value.status_code == 401
        assert httpx.post(f"{server.v1}/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert httpx.get(f"{server.base_url}/metrics").status_code == 200
    finally:
        server.stop()
