"""RedisDatabase against a real redis-server: every driver error leaves as the backend's own
error naming the server, and the set-up runs before the first command, again after it failed,
and never after it succeeded."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from redis_server import free_port, redis_server, redis_url  # noqa: F401

from strata.errors import ConfigError, StrataError
from strata.state.redis_db import RedisDatabase


class BackendError(StrataError):
    pass


def test_a_server_that_is_not_there_is_the_backends_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    db = RedisDatabase(url, error=BackendError, what="redis test store",
                       socket_connect_timeout=1.0)

    async def story() -> None:
        try:
            with pytest.raises(BackendError, match=f"^redis test store {url}: "):
                await db.call(lambda: db.client.ping())
        finally:
            await db.aclose()

    asyncio.run(story())


def test_setup_runs_before_the_first_command_until_it_succeeds(redis_url: str) -> None:  # noqa: F811
    key = f"test:redis_db:{uuid.uuid4().hex}"
    runs: list[str] = []

    async def setup(client: Any) -> None:
        runs.append("setup")
        if len(runs) == 1:  # the server answers an error: the call fails, setup is not done
            await client.execute_command("NO-SUCH-COMMAND")
        await client.set(key, "set up")

    db = RedisDatabase(redis_url, error=BackendError, what="redis test store", setup=setup,
                       decode_responses=True)

    async def story() -> None:
        try:
            with pytest.raises(BackendError, match=f"redis test store {redis_url}: .*unknown"):
                await db.call(lambda: db.client.get(key))
            assert await db.call(lambda: db.client.get(key)) == "set up"
            assert await db.call(lambda: db.client.delete(key)) == 1
            assert runs == ["setup", "setup"]
        finally:
            await db.aclose()

    asyncio.run(story())


def test_an_error_of_the_setup_itself_passes_through(redis_url: str) -> None:  # noqa: F811
    async def setup(client: Any) -> None:
        raise ConfigError("start redis-server with --appendonly yes")

    db = RedisDatabase(redis_url, error=BackendError, what="redis test store", setup=setup)

    async def story() -> None:
        try:
            with pytest.raises(ConfigError, match="--appendonly yes"):
                await db.call(lambda: db.client.ping())
        finally:
            await db.aclose()

    asyncio.run(story())
