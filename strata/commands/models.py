"""`strata models`: the model catalogue of a cluster, and the local model cache.

    strata models add NAME@VERSION URI [--serve-arg=FLAG ...]   register a version (gateway API)
    strata models add BASE:ADAPTER@VERSION DIR                  register a LoRA adapter version
    strata models list [--json]                                 versions, live pointer, instances
    strata models pull [ALIAS]                                  download into the local cache
    strata models cached                                        aliases and whether they are cached

URI: a local path or NFS, file://, s3://BUCKET/PREFIX (checked against its manifest), a known
alias (smollm2), or sim:PROFILE for a simulated instance. When the URI's storage has a manifest,
its sha256 is registered with the version.

A LoRA adapter version is registered under its base model (`BASE:ADAPTER@VERSION`, the base a
registered model's name): DIR is the PEFT adapter directory as the instances see it, and the
sha256 of its files (when DIR is readable here) is registered with it; instances refuse other
files under that version. `strata release ADAPTER@VERSION` then loads it into the base's
running instances and flips the adapter's live pointer (strata/registry/releases/
adapter_steps.py). Requests name the adapter: `model: ADAPTER` (live) or `ADAPTER@VERSION`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from strata.commands.control import ControlClient, add_control_flags
from strata.commands.env import CliEnv
from strata.errors import ConfigError
from strata.protocol.lora import adapter_digest
from strata.registry.models import split_model_version
from strata.store.manifest import local_manifest_sha256


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="the cluster's model versions, and the local model cache")
    msub = p.add_subparsers(dest="models_command", required=True,
                            metavar="{add,list,pull,cached}")
    add = msub.add_parser("add", help="register NAME@VERSION -> URI in the cluster's registry")
    add.add_argument("model", metavar="NAME@VERSION",
                     help="a model's version, or BASE:ADAPTER@VERSION for a LoRA adapter's")
    add.add_argument("uri", help="path, file://, s3://, a known alias, or sim:PROFILE (an "
                                 "adapter: its directory on the instances)")
    add.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                     help="extra `strata serve` flag for this version's instances (repeat; "
                          "write --serve-arg=--max-model-len=2048)")
    listing = msub.add_parser("list", help="the cluster's models: versions, live, canary")
    listing.add_argument("--json", action="store_true", help="print the raw JSON")
    for command in (add, listing):
        add_control_flags(command)
    pull = msub.add_parser("pull", help="download a known model into the local cache")
    pull.add_argument("name", nargs="?", default=None, help="alias (default: smollm2)")
    msub.add_parser("cached", help="known aliases and whether they are cached locally")


def run(args: argparse.Namespace, env: CliEnv) -> int:
    if args.models_command == "pull":
        return _pull(args.name, env.cache_dir)
    if args.models_command == "cached":
        return _cached(env.cache_dir)
    client = ControlClient.from_args(args, env)
    try:
        if args.models_command == "add":
            return _add(client, args)
        body = client.call("GET", "/admin/models")
    finally:
        client.close()
    print(json.dumps(body, indent=2) if args.json else format_models(body["models"]))
    return 0


def _add(client: ControlClient, args: argparse.Namespace) -> int:
    base, name, version = split_adapter(args.model)
    if version is None:
        version = "default"
    sha256 = _adapter_sha256(args.uri) if base else local_manifest_sha256(args.uri)
    body = {"name": name, "version": version, "uri": args.uri, "manifest_sha256": sha256,
            "serve_args": args.serve_arg, "base": base or None}
    stored = client.call("POST", "/admin/models", body)
    digest = stored["manifest_sha256"][:12] or "no manifest"
    base = f"{stored['base']}:" if stored.get("base") else ""
    print(f"registered {base}{stored['name']}@{stored['version']} -> {stored['uri']} "
          f"({digest})")
    return 0


def split_adapter(text: str) -> tuple[str, str, str | None]:
    """"BASE:ADAPTER@VERSION" -> (BASE, ADAPTER, VERSION); "NAME@VERSION" -> ("", NAME, ...)."""
    base, sep, rest = text.rpartition(":")
    if sep and not base:
        raise ConfigError(f"expected BASE:ADAPTER@VERSION, got {text!r}")
    name, version = split_model_version(rest)
    return base, name, version


def _adapter_sha256(uri: str) -> str:
    """The adapter's digest when its directory is here ("" otherwise: the gateway needs it
    then, and says so)."""
    path = Path(uri.removeprefix("file://"))
    if not path.is_dir():
        return ""
    try:
        return adapter_digest(path)
    except OSError as exc:
        raise ConfigError(f"{path} is not a PEFT adapter directory ({exc.strerror}: "
                          f"{exc.filename})") from None


def format_models(models: list[dict[str, Any]]) -> str:
    if not models:
        return "no models registered (strata models add NAME@VERSION URI)"
    rows: list[tuple[str, ...]] = [("MODEL", "VERSION", "ROLE", "INSTANCES", "URI")]
    for model in models:
        rows += _rows(model["name"], model)
        for adapter in model.get("adapters", []):  # listed under their base, indented
            rows += _rows(f"  {adapter['name']} (adapter)", adapter)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def _rows(label: str, model: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per version: its role in the routing record, its routable instances (for an
    adapter: those that list it), its URI."""
    routing = model.get("routing") or {}
    rows: list[tuple[str, ...]] = []
    for v in model["versions"]:
        role = ("live" if v["version"] == routing.get("live") else
                f"canary {routing.get('canary_weight', 0):.0%}"
                if v["version"] == routing.get("canary") else
                "previous" if v["version"] == routing.get("previous") else "")
        rows.append((label, v["version"], role, str(len(v.get("routable_instances", []))),
                     v["uri"]))
    return rows


def _pull(name: str | None, cache_dir: Path) -> int:
    from strata.model.fetch import DEFAULT_MODEL, pull_model

    print(pull_model(name or DEFAULT_MODEL, cache_dir=cache_dir, progress=True))
    return 0


def _cached(cache_dir: Path) -> int:
    from strata.model.fetch import (
        DEFAULT_EMBED_MODEL,
        DEFAULT_MODEL,
        KNOWN_MODELS,
        cached_model_path,
    )

    print(f"{'ALIAS':<12}{'SERVED NAME':<26}{'STATUS':<12}PATH")
    marks = {DEFAULT_MODEL: " (default)", DEFAULT_EMBED_MODEL: " (default, --task embed)"}
    for name, spec in sorted(KNOWN_MODELS.items(), key=lambda kv: (kv[0] != DEFAULT_MODEL,
                                                                   kv[0])):
        path = cached_model_path(spec, cache_dir)
        status = "cached" if path.exists() else "not cached"
        default = marks.get(name, "")
        print(f"{name:<12}{spec.served_name:<26}{status:<12}{path}{default}")
    return 0


__all__ = ["add_parser", "format_models", "run"]
