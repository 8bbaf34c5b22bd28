"""Service statistics declared once. A stats dataclass marks its counts with
:func:`counted`; :meth:`Recorder.add` moves the field and its Prometheus
counter together, so the final statistics (``--stats-file``, the closing log
line) and ``/metrics`` never disagree."""

from __future__ import annotations

from dataclasses import Field, field, fields
from functools import cache
from typing import Any, ClassVar

from prometheus_client import Counter


def counted(description: str, metric: str | None = None, label: str | None = None) -> Any:
    """A count (default 0) that is also the Prometheus counter
    ``hsx_<service>_<metric or field name>``, optionally with one label."""
    return field(default=0, metadata={"description": description, "metric": metric, "label": label})


@cache  # a metric may be registered once per process, however many recorders exist
def _counter(name: str, description: str, label: str | None) -> Counter:
    return Counter(name, description, [label] if label else [])


class Recorder:
    """Base of a service's stats dataclass."""

    service: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            if "description" in f.metadata:
                self._counter(f)  # registered now, so /metrics shows zeros before the first event

    def add(self, name: str, amount: int = 1, label: str | None = None) -> None:
        setattr(self, name, getattr(self, name) + amount)
        f = self.__dataclass_fields__[name]  # type: ignore[attr-defined]
        counter = self._counter(f)
        (counter.labels(label) if label is not None else counter).inc(amount)

    def _counter(self, f: Field[Any]) -> Counter:
        meta = f.metadata
        return _counter(f"hsx_{self.service}_{meta['metric'] or f.name}", meta["description"], meta["label"])
