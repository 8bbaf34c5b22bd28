"""``hsx serve``'s last step (7): the summary table, every lost capture named on
stderr, and the exit status."""

from __future__ import annotations

import sys

from hsx.runtime.errors import ExitCode
from hsx.serving.learning import Learning
from hsx.serving.pipeline import Drained
from hsx.serving.plan import ServePlan
from hsx.serving.reports import ReportReceiver
from hsx.serving.rollbacks import Rollbacks
from hsx.summary import render


def summarize(plan: ServePlan, reports: ReportReceiver, drained: Drained, failures: list[str], seconds: float,
               learning: Learning | None, rollbacks: Rollbacks | None) -> int:
    """Print the summary and name every lost capture; exit 0 when none was lost."""
    print(render(_rows(plan, reports, drained, seconds, learning, rollbacks)), flush=True)
    lost = reports.files.failed + len(reports.files.lost) + reports.samples.failed + drained.lost
    for failure in failures:
        print(f"hsx serve: {failure}", file=sys.stderr)
    for what, ids in (("files promised, never written (the engine was gone)", reports.files.lost),
                      ("samples promised, never acknowledged (the engine was gone)", drained.unconfirmed),
                      ("samples acknowledged, never announced", sorted(drained.missing))):
        if ids:
            print(f"hsx serve: {what}: {', '.join(ids)}", file=sys.stderr)
    ok = not failures and not lost
    print(f"hsx serve: {'stopped' if ok else 'stopped with LOST captures'}", file=sys.stderr)
    return ExitCode.OK if ok else ExitCode.FAILED


def _rows(plan: ServePlan, reports: ReportReceiver, drained: Drained, seconds: float,
          learning: Learning | None, rollbacks: Rollbacks | None) -> list[tuple[str, str]]:
    """The summary table's rows."""
    rows = [("served for", f"{seconds:,.0f} s")]
    for name, tally, on in (("files", reports.files, plan.files is not None),
                            ("samples", reports.samples, plan.sends)):
        if not on:
            continue
        p50, p99 = tally.lag_quantile(0.5), tally.lag_quantile(0.99)
        found = f", {tally.unreported:,} found though never reported: the engine died" if tally.unreported else ""
        rows += [(f"{name} captured", f"{tally.ok:,} ({tally.raw_bytes:,} raw bytes reported{found})"),
                 (f"{name} lost", f"{tally.failed + len(tally.lost):,}"
                                  + (f" ({len(tally.lost):,} promised when the engine was gone)" if tally.lost else "")
                                  + (f": {tally.errors[0]}" if tally.errors else "")),
                 (f"{name} capture lag p50 / p99", "-" if p50 is None else f"{p50:.3f} / {p99:.3f} s")]
    if plan.engine.draft is not None:
        rows += reports.draft_rows(plan.engine.draft)
    if rollbacks is not None:
        rows.append(("drafts rolled back", f"{rollbacks.count:,}"))
    if learning is not None:
        rows += learning.rows()
    if plan.output is not None:
        rows += [("samples announced", f"{drained.announced:,}"),
                 ("samples not announced", f"{len(drained.missing):,}"),
                 ("samples dead-lettered", ", ".join(f"{n:,} {c}" for c, n in sorted(drained.dead.items())) or "0"),
                 ("dataset", plan.output)]
    if plan.files is not None:
        if reports.earlier:
            rows.append(("files an earlier server lost",
                         f"{len(reports.earlier):,} (found at the start, their locks removed)"))
        rows.append(("files in", plan.files))
    return rows
