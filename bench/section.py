"""What every engine section of ``make bench`` shares on its command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parser(doc: str | None) -> argparse.ArgumentParser:
    """``--quick``, ``--rounds`` and ``--out``, the flags ``python -m bench`` passes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke check)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="also write the results here as JSON (vLLM logs to stdout)")
    return p


def emit(results: dict[str, object], out: Path | None) -> None:
    """Print the results, and write them to ``out`` (the file ``python -m bench`` merges)."""
    text = json.dumps(results, indent=2)
    if out:
        out.write_text(text + "\n")
    print(text)
