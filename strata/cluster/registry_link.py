"""A launcher's synchronous link to the registries, and one reconcile round over it.

Launchers are synchronous loops; the registries are async. A `RegistryLink` owns one private
event loop and opens the model and instance registry clients on it once (a Redis client is
bound to the loop that created it), so a round does not reconnect.

A round that cannot reach the registry logs it and does nothing: the next round retries, and
the processes already running are left as they are. A registry outage never stops a cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from strata.cluster.deployments import Plan, Slot, Start, plan
from strata.errors import StrataError
from strata.registry import Registry, create_registry
from strata.registry.models import (
    Deployment,
    DeploymentState,
    ModelRegistry,
    ModelVersion,
    create_model_registry,
)

log = logging.getLogger("strata.up")
T = TypeVar("T")


class RegistryLink:
    """The model and instance registries at `url`, called synchronously."""

    def __init__(self, url: str, *, models: ModelRegistry | None = None,
                 instances: Registry | None = None) -> None:
        """Clients are opened from `url` on first use unless given (in-process tests)."""
        self.url = url
        self._loop = asyncio.new_event_loop()
        self._models = models
        self._instances = instances
        self._versions: dict[str, ModelVersion] = {}  # versions are immutable: cached

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion on the link's loop (where its clients live)."""
        return self._loop.run_until_complete(coro)

    @property
    def models(self) -> ModelRegistry:
        if self._models is None:
            self._models = create_model_registry(self.url)
        return self._models

    @property
    def instances(self) -> Registry:
        if self._instances is None:
            self._instances = create_registry(self.url)
        return self._instances

    def read_desired(self) -> tuple[list[Deployment], dict[str, ModelVersion]]:
        """Every deployment, and the catalogue entry of each one found."""
        return self.run(self._read_desired())

    async def _read_desired(self) -> tuple[list[Deployment], dict[str, ModelVersion]]:
        deployments = await self.models.list_deployments()
        for d in deployments:
            if d.key not in self._versions:
                found = await self.models.get_version(d.name, d.version)
                if found is not None:
                    self._versions[d.key] = found
        return deployments, {d.key: self._versions[d.key] for d in deployments
                             if d.key in self._versions}

    def finish_retired(self, deployment: Deployment) -> None:
        """Delete a RETIRING deployment none of whose instances runs any more."""
        self.run(self._finish_retired(deployment))

    async def _finish_retired(self, deployment: Deployment) -> None:
        current = {d.key: d for d in await self.models.list_deployments()}.get(deployment.key)
        if current is None or current.state is not DeploymentState.RETIRING:
            return  # re-activated (or deleted) since this round read it: not ours to delete
        # an instance that died while draining left its record behind; none of them runs now
        for record in await self.instances.list_instances():
            if record.model == deployment.name and record.version == deployment.version:
                await self.instances.deregister(record.instance_id)
        if await self.models.delete_deployment(deployment.name, deployment.version,
                                               expected_revision=current.revision):
            log.info("deployment %s retired: every instance drained", deployment.key)

    def close(self) -> None:
        async def close_all() -> None:
            for client in (self._models, self._instances):
                if client is not None:
                    await client.close()

        try:
            self.run(close_all())
        finally:
            self._loop.close()


class Reconciler:
    """Runs rounds of `plan` against one launcher's owned instances through a RegistryLink."""

    def __init__(self, link: RegistryLink, *, start: Callable[[Start], None],
                 drain: Callable[[str], None]) -> None:
        self.link = link
        self._start = start
        self._drain = drain
        self._last_problem = ""

    def round(self, owned: Mapping[str, Slot]) -> Plan | None:
        """Read, plan, act. None when the registry could not be read (logged; retried)."""
        try:
            deployments, versions = self.link.read_desired()
            actions = plan(deployments, versions, owned)
            for instance in actions.start:
                self._start(instance)
            for instance_id in actions.drain:
                self._drain(instance_id)
            for deployment in actions.delete:
                self.link.finish_retired(deployment)
        except (StrataError, OSError) as e:
            self._report(f"reconcile with registry {self.link.url} failed this round ({e}); "
                         "retrying")
            return None
        self._report(_missing_message(actions.missing_versions))
        return actions

    def _report(self, problem: str) -> None:
        """Log a problem once while it lasts (rounds run twice a second), and its end."""
        if problem and problem != self._last_problem:
            log.warning("%s", problem)
        elif not problem and self._last_problem:
            log.info("reconcile: back to normal")
        self._last_problem = problem


def _missing_message(keys: tuple[str, ...]) -> str:
    if not keys:
        return ""
    return (f"deployments {', '.join(keys)} name versions missing from the model catalogue; "
            "add them with `strata models add NAME@VERSION URI`")


__all__ = ["Reconciler", "RegistryLink"]
