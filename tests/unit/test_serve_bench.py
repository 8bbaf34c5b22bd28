"""bench.serve's bookkeeping: which servers are up together, and how passes become figures."""

from __future__ import annotations

import pytest

from bench.serve import ARMS, GROUPS, add_worst, groups, summarize


def test_every_arm_is_in_a_group_with_plain() -> None:
    chosen = groups(ARMS)
    assert chosen == [list(g) for g in GROUPS]
    assert {arm for g in chosen for arm in g} == set(ARMS)
    assert all(g[0] == "plain" for g in chosen)


@pytest.mark.parametrize(("arms", "expected"), [
    (["files"], [["plain", "files"]]),
    (["plain", "method"], [["plain", "method"]]),  # in both groups: runs once
    (["plain_sync", "method"], [["plain", "plain_sync", "method"]]),  # the group that covers both
    (["drafts", "kafka"], [["plain", "kafka"], ["plain", "drafts"]]),
])
def test_a_subset_runs_each_arm_once_beside_plain(arms: list[str], expected: list[list[str]]) -> None:
    assert groups(arms) == expected


def test_summary_is_the_median_over_passes_with_an_interval_around_it() -> None:
    ratios = [0.9, 1.1, 1.0, 0.95, 1.05]
    passes = [{"serve_files_c8_requests_per_s": 2.0 * r, "serve_files_c8_vs_plain": r} for r in ratios]
    figures = summarize(passes)
    assert figures["serve_files_c8_vs_plain"] == 1.0
    assert figures["serve_files_c8_vs_plain_rounds"] == ratios
    low, high = figures["serve_files_c8_vs_plain_ci95"]
    assert min(ratios) <= low < 1.0 < high <= max(ratios)
    assert "serve_files_c8_requests_per_s_ci95" not in figures  # intervals are for ratios


def test_worst_names_the_lowest_ratio_and_carries_its_interval() -> None:
    results = {"serve_files_c1_vs_plain": 0.97, "serve_files_c1_vs_plain_ci95": [0.9, 1.0],
               "serve_kafka_c8_vs_plain": 0.93, "serve_kafka_c8_vs_plain_ci95": [0.88, 0.99],
               "serve_kafka_c8_vs_plain_sync": 0.5, "serve_method_c8_vs_plain": 0.1}
    add_worst(results)
    assert results["serve_capture_vs_plain_min"] == 0.93
    assert results["serve_capture_vs_plain_min_ci95"] == [0.88, 0.99]
    assert results["serve_method_vs_plain_min"] == 0.1
    assert results["serve_files_vs_stock_min"] is None
