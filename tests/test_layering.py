"""The import rules of DESIGN.md, checked by parsing every module under strata/ with `ast`.

- engine: only strata.types, strata.errors, strata.engine.*, the stdlib and numpy; no asyncio,
  sockets or HTTP (it is pure compute and bookkeeping).
- model: never server, gateway, cli (nor the HTTP clients, bench, or web frameworks).
- server: only types, errors, engine, model, protocol, state, registry and itself; never cli.
- gateway: only types, errors, protocol, state, registry and itself (never engine, model, server).
- protocol, state, registry, store: never engine, model, server, gateway, cluster or cli.
- tracing (OpenTelemetry, which the server and the gateway may import): never engine, model,
  server, gateway or cli; the engine never imports it (stdlib and numpy only): it records its
  phases as plain data, which the server turns into spans.
- sim: no torch (64 simulated instances share one machine); of the model only the tokenizer.
- only strata/cli.py reads environment variables.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "strata"

LEAVES = {"strata.types", "strata.errors", "strata.clock"}  # every layer may import these
ENGINE_STRATA = {*LEAVES, "strata.engine"}
ENGINE_THIRD_PARTY = {"numpy"}
ENGINE_STDLIB_BANNED = {"asyncio", "socket", "http", "selectors", "ssl"}
MODEL_BANNED = {"strata.server", "strata.gateway", "strata.cli", "strata.clients",
                "strata.bench", "fastapi", "starlette", "uvicorn", "httpx"}
PACKAGE_ROOT_NAMES = {"strata", "strata.__version__"}
SERVER_STRATA = {*LEAVES, "strata.engine", "strata.model",
                 "strata.protocol", "strata.state", "strata.registry", "strata.server",
                 "strata.tracing"}
GATEWAY_BANNED = {"strata.engine", "strata.model", "strata.server", "strata.cli"}
GATEWAY_STRATA = {*LEAVES, "strata.protocol", "strata.state",
                  "strata.registry", "strata.gateway", "strata.tracing"}
TRACING_BANNED = {"strata.engine", "strata.model", "strata.server", "strata.gateway",
                  "strata.cluster", "strata.cli", "strata.commands"}
LOWER_LAYERS = {"protocol", "state", "registry", "store"}
SIM_BANNED = {"torch", "strata.gateway", "strata.cluster", "strata.cli", "strata.commands"}
LOWER_BANNED = {"strata.engine", "strata.model", "strata.server", "strata.gateway",
                "strata.cluster", "strata.cli", "strata.commands", "strata.sim"}
# stage 6: the autoscaler and the planner call the gateway's own parts, never the instance's
AUTOSCALE_BANNED = {"strata.engine", "strata.model", "strata.server", "strata.cluster",
                    "strata.commands", "strata.cli", "strata.plan"}
PLAN_BANNED = {"torch", "strata.model", "strata.server", "strata.cluster", "strata.commands",
               "strata.cli"}
CLUSTER_BANNED = {"strata.commands", "strata.cli", "strata.plan", "strata.autoscale"}
ENV_READERS = {"environ", "environb", "getenv", "getenvb"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return sorted(found, key=lambda item: item[1])


def _under(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _import_violation(layer: str, name: str) -> str | None:
    top = name.split(".")[0]
    if layer == "engine":
        if top == "strata":
            # `from strata import errors` resolves to strata.errors; bare `strata` is not allowed
            return None if _under(name, ENGINE_STRATA) else "engine may not import it"
        if top in ENGINE_STDLIB_BANNED:
            return "engine has no asyncio, sockets or HTTP"
        if top in sys.stdlib_module_names or top in ENGINE_THIRD_PARTY:
            return None
        return "engine imports only the stdlib and numpy"
    if layer == "model" and _under(name, MODEL_BANNED):
        return "model never imports server, gateway, cli, clients or web libraries"
    if layer == "server" and top == "strata" and not (
        name in PACKAGE_ROOT_NAMES or _under(name, SERVER_STRATA)
    ):
        return "server imports only engine, model, protocol, state, registry (never cli)"
    if layer == "gateway" and _under(name, GATEWAY_BANNED):
        return "gateway never imports engine, model or server"
    if layer == "gateway" and top == "strata" and not (
        name in PACKAGE_ROOT_NAMES or _under(name, GATEWAY_STRATA)
    ):
        return "gateway imports only protocol, state, registry"
    if layer == "sim" and (_under(name, SIM_BANNED) or (
            _under(name, {"strata.model"}) and not _under(name, {"strata.model.tokenizer"}))):
        return "sim runs without torch: of the model it uses only the tokenizer"
    if layer == "autoscale" and _under(name, AUTOSCALE_BANNED):
        return "autoscale reads the gateway's stats and writes the registry; never an instance"
    if layer == "plan" and _under(name, PLAN_BANNED):
        return "plan runs the engine, the gateway and the simulator on a virtual clock, no torch"
    if layer == "cluster" and _under(name, CLUSTER_BANNED):
        return "cluster launches processes; it never imports the CLI, the planner or autoscaler"
    if layer == "tracing" and _under(name, TRACING_BANNED):
        return "tracing is below the server and the gateway and never imports a layer above"
    if layer in LOWER_LAYERS and _under(name, LOWER_BANNED):
        return f"{layer} is below engine, server and gateway and never imports them"
    return None


def _reads_env(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_READERS:
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in ENV_READERS for alias in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def violations(module: str, source: str, *, is_package: bool = False) -> list[str]:
    """Every broken rule in one module's source, as 'module:line: name: why'."""
    tree = ast.parse(source)
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 else ""
    found = []
    for name, line in imported_names(tree, module, is_package):
        why = _import_violation(layer, name)
        if why:
            found.append(f"{module}:{line}: {name}: {why}")
    if module != "strata.cli":
        found += [f"{module}:{line}: os.environ: only strata/cli.py reads the environment"
                  for line in _reads_env(tree)]
    return found


def all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_tree_has_modules_in_every_built_layer() -> None:
    names = {module_name(p) for p in all_modules()}
    assert {"strata.types", "strata.errors", "strata.engine.config", "strata.cli"} <= names


@pytest.mark.parametrize("path", all_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_follows_the_import_rules(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert violations(module_name(path), source, is_package=path.name == "__init__.py") == []


def test_checker_catches_engine_importing_torch_asyncio_and_server() -> None:
    source = (
        "import numpy as np\nimport torch\nimport asyncio\nfrom strata.server.app import x\n"
        "from strata.engine.config import CacheConfig\nfrom ..errors import ConfigError\n"
        "from ..model import llama\nimport httpx\n"
    )
    assert violations("strata.engine.scheduler", source) == [
        "strata.engine.scheduler:2: torch: engine imports only the stdlib and numpy",
        "strata.engine.scheduler:3: asyncio: engine has no asyncio, sockets or HTTP",
        "strata.engine.scheduler:4: strata.server.app.x: engine may not import it",
        "strata.engine.scheduler:7: strata.model.llama: engine may not import it",
        "strata.engine.scheduler:8: httpx: engine imports only the stdlib and numpy",
    ]


def test_checker_catches_model_server_and_gateway_reaching_up() -> None:
    assert violations("strata.model.loader", "from strata.cli import main\n") == [
        "strata.model.loader:1: strata.cli.main: model never imports server, gateway, cli, "
        "clients or web libraries"
    ]
    assert violations("strata.server.app", "def f():\n    from strata import cli\n") == [
        "strata.server.app:2: strata.cli: server imports only engine, model, protocol, state, "
        "registry (never cli)"
    ]
    assert violations("strata.gateway.routing.pipeline", "from ...engine import engine\n") == [
        "strata.gateway.routing.pipeline:1: strata.engine.engine: gateway never imports engine, "
        "model or server"
    ]


def test_checker_keeps_lower_layers_and_the_gateway_apart() -> None:
    assert violations("strata.registry.instances.sqlite", "from strata.server import app\n") == [
        "strata.registry.instances.sqlite:1: strata.server.app: registry is below engine, server "
        "and gateway and never imports them"
    ]
    assert violations("strata.gateway.app", "import strata.store.s3\n") == [
        "strata.gateway.app:1: strata.store.s3: gateway imports only protocol, state, registry"
    ]
    assert violations("strata.gateway.app", "from strata.registry import create_registry\n") == []


def test_checker_keeps_torch_out_of_the_simulator() -> None:
    source = "import torch\nfrom strata.model.llama import LlamaModel\n" \
             "from strata.model.tokenizer import Tokenizer\n"
    assert [v.split(": ")[0] for v in violations("strata.sim.executor", source)] == [
        "strata.sim.executor:1", "strata.sim.executor:2"
    ]


def test_checker_lets_only_cli_read_the_environment() -> None:
    source = "import os\nfrom os import getenv\nx = os.environ.get('A')\ny = os.getenv('B')\n"
    assert violations("strata.cli", source) == []
    assert [v.split(": ")[0] for v in violations("strata.server.app", source)] == [
        "strata.server.app:2", "strata.server.app:3", "strata.server.app:4"
    ]


def test_checker_keeps_opentelemetry_out_of_the_engine_and_tracing_below_the_layers() -> None:
    assert violations("strata.engine.engine", "from opentelemetry import trace\n") == [
        "strata.engine.engine:1: opentelemetry.trace: engine imports only the stdlib and numpy"]
    assert violations("strata.engine.engine", "from strata import tracing\n") == [
        "strata.engine.engine:1: strata.tracing: engine may not import it"]
    assert violations("strata.tracing.spans", "from strata.engine import timeline\n") == [
        "strata.tracing.spans:1: strata.engine.timeline: tracing is below the server and the "
        "gateway and never imports a layer above"]
    assert violations("strata.gateway.upstream.proxy", "from strata import tracing\n") == []
    assert violations("strata.server.app", "from strata.tracing import span\n") == []


def test_relative_imports_resolve_against_the_package() -> None:
    tree = ast.parse("from . import block_pool\nfrom .. import errors\n")
    assert imported_names(tree, "strata.engine", is_package=True) == [
        ("strata.engine.block_pool", 1), ("strata.errors", 2)
    ]
    assert imported_names(tree, "strata.engine.scheduler", is_package=False) == [
        ("strata.engine.block_pool", 1), ("strata.errors", 2)
    ]


def test_checker_keeps_stage_6_on_the_gateways_seams() -> None:
    assert violations("strata.autoscale.law", "from strata.server import metrics\n") == [
        "strata.autoscale.law:1: strata.server.metrics: autoscale reads the gateway's stats and "
        "writes the registry; never an instance"]
    assert violations("strata.plan.fleet", "import torch\n") == [
        "strata.plan.fleet:1: torch: plan runs the engine, the gateway and the simulator on a "
        "virtual clock, no torch"]
    assert violations("strata.cluster.local", "from strata.commands import up\n") == [
        "strata.cluster.local:1: strata.commands.up: cluster launches processes; it never "
        "imports the CLI, the planner or autoscaler"]
    assert violations("strata.plan.fleet", "from strata.gateway.routing import pd\n") == []


def import_graph() -> dict[str, set[str]]:
    """strata module -> the strata modules it imports (lazy imports included: a function's
    import runs too; `from package import name` counts the package)."""
    modules = {module_name(p): p for p in all_modules()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                node.body = []
        for imported, _ in imported_names(tree, name, path.name == "__init__.py"):
            for target in (imported, imported.rpartition(".")[0]):
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: its strongly connected components of two or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_inside_strata() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
