"""What POST /admin/models may register as a LoRA adapter version (a body with `base`).

    base        a model registered here (its versions are not adapters): else 404
    name        not a model's name, nor an adapter of another base: else 409
    uri         a directory on the instances (a path or file://, under --model-root as any
                version's: intake.py); not s3://, an alias or sim:
    sha256      the adapter's digest (strata/protocol/lora.py). When the directory is readable
                here too, its files are hashed: a sha256 given that differs is a 400 (the files
                are not the version the caller meant), a missing one is filled in. When it is
                not, the sha256 must be given; every instance checks it when it loads the files
    serve_args  none (an adapter shapes no instance)
"""

from __future__ import annotations

from pathlib import Path

from strata.errors import ConfigError, ConflictError, ModelNotFoundError
from strata.protocol.lora import adapter_digest
from strata.registry.models import ModelRegistry, ModelVersion
from strata.registry.releases.adapter_steps import adapter_path


async def check_adapter(version: ModelVersion, models: ModelRegistry) -> ModelVersion:
    """`version` as it may be stored (its sha256 filled in), or raises saying why not."""
    await _check_names(version, models)
    if version.serve_args:
        raise ConfigError(f"adapter version {version.key} takes no serve_args")
    if "://" in version.uri and not version.uri.startswith("file://") \
            or version.uri.startswith(("sim:", "alias:")):
        raise ConfigError(f"adapter version {version.key}: uri must be a directory on the "
                          f"instances (a path or file://), got {version.uri!r}")
    return _with_digest(version)


async def _check_names(version: ModelVersion, models: ModelRegistry) -> None:
    registered = await models.list_versions()
    bases = {v.name for v in registered if not v.is_adapter}
    if version.base not in bases:
        raise ModelNotFoundError(
            f"unknown base model {version.base!r} for adapter {version.name!r}; registered "
            f"models: {', '.join(sorted(bases)) or 'none'} (add it with `strata models add "
            f"{version.base}@VERSION URI`)", param="base")
    if version.name in bases:
        raise ConflictError(f"{version.name!r} is a model's name; an adapter needs its own")
    other = next((v.base for v in registered
                  if v.name == version.name and v.is_adapter and v.base != version.base), None)
    if other is not None:
        raise ConflictError(f"adapter {version.name!r} is registered over {other!r}, not "
                            f"{version.base!r}; give this one another name")


def _with_digest(version: ModelVersion) -> ModelVersion:
    root = Path(adapter_path(version.uri))
    if not root.is_dir():
        if not version.manifest_sha256:
            raise ConfigError(f"adapter version {version.key}: {root} is not a directory on the "
                              "gateway, so give its manifest_sha256 (the sha256 of "
                              "adapter_config.json then adapter_model.safetensors)")
        return version
    try:
        digest = adapter_digest(root)
    except OSError as exc:
        raise ConfigError(f"adapter version {version.key}: {root} is not a PEFT adapter "
                          f"directory ({exc.strerror}: {exc.filename})") from None
    if version.manifest_sha256 and version.manifest_sha256 != digest:
        raise ConfigError(f"adapter version {version.key}: the files at {root} have sha256 "
                          f"{digest}, not {version.manifest_sha256} (the manifest given)")
    return ModelVersion(version.name, version.version, version.uri, digest, (),
                        version.created_at, version.base)


__all__ = ["check_adapter"]
