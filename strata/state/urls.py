"""The store URLs: which URL scheme names which backend, for every store.

A store is a package, strata/state/{store}/ (the registries': strata/registry/instances/ and
strata/registry/models/), with a `base`
module (the Protocol and its contract) and one module per backend; `SCHEMES` below says which
URL form names which backend module and which stores have it. Every factory looks its URL up
here (`scheme_of`: an unknown one is a ConfigError listing that store's forms) and every
`--help` text lists the forms from here (`schemes_help`).

The factories in state/ import the backend module only when a URL names it (`backend_module`),
so a process that never names a Redis URL never imports redis, and call its
`from_url(url, options)`, options being the store's frozen `*Options` (base.py). A new backend
is that module plus its row (or its store's name added to a row) here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from strata.errors import ConfigError

SENTINEL_PREFIX = "redis+sentinel://"  # a Redis primary found through Sentinels (redis_db.py)
STORES = {  # store -> what its messages call it
    "sessions": "session store",
    "pins": "pin store",
    "kv_store": "KV store",
    "response_cache": "response cache",
    "usage": "usage store",
    "registry": "registry",
    "model_registry": "model registry",
}
EVERY_STORE = tuple(STORES)
PACKAGES = {  # store -> the package of its backend modules, where not strata.state.{store}
    "registry": "strata.registry.instances",
    "model_registry": "strata.registry.models",
}


@dataclass(frozen=True, slots=True)
class Scheme:
    """One URL form: `form` as errors and `--help` show it, the backend module that serves it
    (strata/state/{store}/{backend}.py) and the stores that have that backend."""

    form: str
    backend: str
    stores: tuple[str, ...]

    @property
    def prefix(self) -> str:
        return self.form.split("://")[0] + "://"

    def matches(self, url: str) -> bool:
        """`url` is of this form. A form that is its bare prefix (memory://) takes no address;
        its name alone ("memory") is accepted too."""
        if self.form == self.prefix:
            return url in (self.prefix, self.prefix[: -len("://")])
        return url.startswith(self.prefix)


SCHEMES = (
    #      form                      backend    stores that have it
    Scheme("memory://",              "memory",  EVERY_STORE),  # one process
    Scheme("sqlite:///PATH",         "sqlite",  ("sessions", "pins", "response_cache", "usage",
                                                 "registry", "model_registry")),  # one machine
    Scheme("redis://HOST:PORT/DB",   "redis",   EVERY_STORE),  # many machines
    Scheme("rediss://HOST:PORT/DB",  "redis",   EVERY_STORE),  # many machines, over TLS
    Scheme("redis+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]", "redis",
           EVERY_STORE),  # many machines, the primary found through Sentinels (failover)
)


def schemes_of(store: str) -> tuple[Scheme, ...]:
    """The URL forms `store` accepts, in the table's order."""
    if store not in STORES:
        raise ConfigError(f"unknown store {store!r}; use one of: {', '.join(STORES)}")
    return tuple(s for s in SCHEMES if store in s.stores)


def schemes_help(store: str) -> str:
    """The URL forms of `store`, for `--help` and errors: "memory://, sqlite:///PATH, ..."."""
    return ", ".join(s.form for s in schemes_of(store))


def scheme_of(store: str, url: str) -> Scheme:
    """The row of `url` among `store`'s schemes; ConfigError listing them when none matches."""
    for scheme in schemes_of(store):
        if scheme.matches(url):
            return scheme
    raise ConfigError(f"unknown {STORES[store]} URL {url!r}; use one of: {schemes_help(store)}")


def backend_module(store: str, url: str) -> ModuleType:
    """{package}.{backend} for `url`, imported now (the package is strata.state.{store}, or the
    registry's, PACKAGES): the module whose `from_url(url, options)` opens the store."""
    package = PACKAGES.get(store, f"strata.state.{store}")
    return importlib.import_module(f"{package}.{scheme_of(store, url).backend}")


__all__ = ["EVERY_STORE", "PACKAGES", "SCHEMES", "STORES", "Scheme", "backend_module", "scheme_of",
           "schemes_help", "schemes_of"]
