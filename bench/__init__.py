"""Side-by-side benchmarks. Run from the repository root: ``python -m bench.<name>``."""
