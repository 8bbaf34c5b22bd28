"""Write the seed corpora: ``python -m tests.fuzz.seed``.

Every target's seeds (``seeds()`` of :data:`tests.fuzz.target.MODULES`, made from
real records) go to ``tests/fuzz/corpus/<target>/<sha1 prefix>``. The corpus
folders are generated: files and folders that are no seed any more are removed,
so the committed corpus is exactly what this writes.
"""

from __future__ import annotations

import hashlib
import importlib
import shutil
import sys
from pathlib import Path

from tests.fuzz.target import CORPUS, MODULES, targets

MAX_FILES = 40
MAX_BYTES = 1 << 20
"""Per target: the replay in ``make test`` runs every file, and the repository keeps them."""


def all_seeds() -> dict[str, list[bytes]]:
    """The seeds of every module's targets, by target name."""
    merged: dict[str, list[bytes]] = {}
    for module in MODULES:
        for name, inputs in importlib.import_module(module).seeds().items():
            if name in merged:
                raise ValueError(f"two modules give seeds for {name!r}")
            merged[name] = inputs
    return merged


def write(corpus: Path = CORPUS) -> dict[str, list[Path]]:
    """Write the seeds under ``corpus``; the files of each target. Raises
    ``ValueError`` for a target without seeds, seeds of no target, or a corpus
    over :data:`MAX_FILES` / :data:`MAX_BYTES`."""
    seeds, names = all_seeds(), set(targets())
    if set(seeds) != names:
        raise ValueError(f"targets without seeds: {sorted(names - set(seeds))}; "
                         f"seeds without a target: {sorted(set(seeds) - names)}")
    for name, inputs in seeds.items():
        unique = set(inputs)
        if not unique or len(unique) > MAX_FILES or sum(map(len, unique)) > MAX_BYTES:
            raise ValueError(f"{name}: {len(unique)} seeds of {sum(map(len, unique))} bytes; give 1 to {MAX_FILES} "
                             f"of at most {MAX_BYTES} bytes in all")
    for folder in corpus.iterdir() if corpus.is_dir() else ():
        if folder.is_dir() and folder.name not in seeds:
            shutil.rmtree(folder)
    written: dict[str, list[Path]] = {}
    for name, inputs in sorted(seeds.items()):
        folder = corpus / name
        folder.mkdir(parents=True, exist_ok=True)
        files = {folder / hashlib.sha1(data).hexdigest()[:16]: data for data in inputs}
        for stale in set(folder.iterdir()) - set(files):
            stale.unlink()
        for path, data in files.items():
            path.write_bytes(data)
        written[name] = sorted(files)
    return written


def main() -> int:
    """Write the corpora and say how much went where."""
    for name, files in write().items():
        print(f"{name:<20} {len(files):>3} files {sum(p.stat().st_size for p in files):>8} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
