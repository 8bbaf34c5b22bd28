"""``python -m bench.pipeline_by_reference``: :mod:`bench.pipeline`'s e2e vs
extraction alone with hidden states by reference (the extractor and the sinks
staging through a directory, ``--payload-store``): ``e2e_ratio_by_reference``
and ``pipeline_by_reference_*``, a section of ``make bench`` of its own."""

from __future__ import annotations

import sys

from bench import pipeline

if __name__ == "__main__":
    sys.argv.insert(1, "--by-reference")
    pipeline.main()
