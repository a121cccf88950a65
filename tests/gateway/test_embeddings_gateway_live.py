"""/v1/embeddings behind the gateway: a fleet of one embed instance (tiny BERT) and one
simulated generate instance; `model` picks the instance, so embeddings reach the encoder and
chat the decoder, through one gateway URL and the official `openai` client."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_fleet import ServedApp, serve_app
from live_server import LiveServer, start_embed_server
from sim_instances import start_sim_instance
from tiny_bert import HIDDEN, make_tiny_bert_dir

from strata.commands import gateway as gateway_command
from strata.commands.env import CliEnv
from strata.gateway.app import create_gateway_app
from strata.gateway.routing.sources import StaticSource

ENV = CliEnv(cache_dir=Path("/nonexistent"), run_dir=Path("/nonexistent"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedApp, LiveServer]]:
    tmp = tmp_path_factory.mktemp("embed-gateway")
    embed = start_embed_server(make_tiny_bert_dir(tmp / "bert"))
    generate = start_sim_instance(model="sim")
    parser = argparse.ArgumentParser()
    gateway_command.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["gateway", "--instances", embed.base_url, generate.url,
                              "--port", "0", "--health-check-interval-s", "0.2"])
    config = gateway_command.build_config(args, ENV)
    control = httpx.AsyncClient(timeout=1.0)
    gateway = serve_app(create_gateway_app(config, StaticSource(config.instance_urls, control),
                                           control_client=control))
    yield gateway, embed
    gateway.stop()
    embed.stop()
    generate.stop()


def test_model_routes_embeddings_to_the_encoder_and_chat_to_the_decoder(
        fleet: tuple[ServedApp, LiveServer]) -> None:
    gateway, embed = fleet
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=embed.v1, api_key="unused", max_retries=0)
    assert sorted(m.id for m in client.models.list().data) == ["sim", "tiny-bert"]
    for _ in range(4):  # every one reaches the encoder, never the generate instance
        r = client.embeddings.create(model="tiny-bert", input=["hello world", "the fox"],
                                     encoding_format="float")
        assert [len(d.embedding) for d in r.data] == [HIDDEN, HIDDEN]
    assert r.data[0].embedding == direct.embeddings.create(
        model="tiny-bert", input="hello world", encoding_format="float").data[0].embedding
    assert len(client.embeddings.create(model="tiny-bert", input="x").data[0].embedding) == HIDDEN
    chat = client.chat.completions.create(model="sim", max_tokens=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-bert", input=[])
    assert "input must be" in str(caught.value)
