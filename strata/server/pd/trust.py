"""Which hand-off handles a decode instance follows: only ones its own fleet wrote.

A handle names the instance D pulls from, and D sends that instance the fleet's internal key;
a handle made up by anyone else would make D fetch from (and hand the key to) any URL, and
import whatever blocks came back. So, before anything is contacted:

    with internal keys   the handle must carry the seal the gateway put over every field
                         (strata/protocol/seal.py); its URL is then the gateway's own choice
    without, but with    the handle must name an instance the registry lists, by id; D pulls
    a registry           from the URL the registry holds for it, never the handle's
    with neither         no handle is followed: such an instance cannot tell a hand-off from a
                         forgery

Each refusal is a 400 (`InvalidRequestError`) that names why (a 503 when the registry cannot
be read); nothing is fetched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from strata.errors import InvalidRequestError, OverloadedError, RegistryError
from strata.protocol.seal import is_sealed
from strata.registry.instances.base import Registry
from strata.server.pd.wire import Handle, parse_handle_json


class HandleTrust:
    """Admits the handles of this instance's fleet (see the module docstring)."""

    def __init__(self, internal_keys: Sequence[str], registry: Registry | None) -> None:
        self.internal_keys = tuple(internal_keys)
        self.registry = registry

    async def admit(self, text: str) -> Handle:
        """The handle `text` holds, with the URL to pull from; raises InvalidRequestError
        (400) for one this fleet did not write."""
        data = parse_handle_json(text)
        if self.internal_keys:
            if not is_sealed(data, self.internal_keys):
                raise InvalidRequestError("hand-off handle not sealed with this fleet's internal "
                                          "key: only a gateway of the fleet gives handles")
            return Handle.of(data)
        if self.registry is None:
            raise InvalidRequestError("this instance follows hand-off handles only with the "
                                      "fleet's internal key (--internal-key-file) or a registry "
                                      "(--registry); it prefills itself without the handle")
        handle = Handle.of({**data, "url": data.get("url") or "http://unlisted"})
        return dataclasses.replace(handle, url=await self._listed_url(handle.instance_id))

    async def _listed_url(self, instance_id: str) -> str:
        assert self.registry is not None
        try:
            record = await self.registry.get(instance_id) if instance_id else None
        except RegistryError as exc:
            raise OverloadedError(f"the registry could not confirm the hand-off's instance "
                                  f"{instance_id!r}: {exc}", status_code=503) from None
        if record is None:
            raise InvalidRequestError(f"hand-off handle names instance {instance_id!r}, which "
                                      "the registry does not list")
        return record.url


__all__ = ["HandleTrust"]
