"""The LoRA adapters an engine serves, held by content digest (strata.model.lora).

A request carries its adapter's digest (`Request.lora_digest`, set by the server from the name
it asked for) from admission to its end, so it runs on the weights it was admitted with
whatever happens to the name meanwhile. An adapter's weights go through three states:

    served    added (`add`): new requests may name it
    retired   no name maps to it any more (`retire`): a new request naming it is refused
              (ModelNotFoundError); the weights stay while a request admitted with them lives
    freed     the last such request ended (`free_unused`, after every step): the executor
              drops the weights

Adding the same digest again serves it again (a retired adapter loaded back before its last
request ended). Only the engine's thread calls these, between steps.
"""

from __future__ import annotations

from typing import Any

from strata.engine.executor import LoraExecutor
from strata.engine.request import Request
from strata.errors import ConfigError, ModelNotFoundError


class Adapters:
    def __init__(self, executor: object) -> None:
        self._executor = executor if isinstance(executor, LoraExecutor) else None
        self._retired: set[str] = set()

    @property
    def num_retired(self) -> int:
        """Adapters no name serves whose weights requests in flight still use."""
        return len(self._retired)

    def add(self, adapter: Any) -> str:
        """Serve `adapter` (the executor's kind); its digest."""
        if self._executor is None:
            raise ConfigError("this engine's executor cannot serve LoRA adapters")
        digest = self._executor.add_lora(adapter)
        self._retired.discard(digest)
        return digest

    def retire(self, digest: str, in_use: set[str]) -> None:
        """Refuse new requests for `digest`; free it once none of `in_use` (the digests of the
        requests in flight, then as they end) names it."""
        self._retired.add(digest)
        self.free_unused(in_use)

    def check(self, request: Request) -> None:
        """A request whose adapter is retired or was never added is refused, by its name."""
        digest = request.lora_digest
        if not digest:
            return
        if digest in self._retired or self._executor is None \
                or not self._executor.has_lora(digest):
            raise ModelNotFoundError(f"The model `{request.lora_name}` does not exist (its LoRA "
                                     "adapter is not loaded)", param="model")

    def free_unused(self, in_use: set[str]) -> None:
        """Free every retired adapter that no request in `in_use` names."""
        if not self._retired or self._executor is None:
            return
        for digest in self._retired - in_use:
            self._executor.remove_lora(digest)
        self._retired &= in_use


__all__ = ["Adapters"]
