"""The ``manifests`` fixture: each overlay of k8s/, rendered, for the tests/k8s modules."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import OVERLAYS, Manifests


@pytest.fixture(params=OVERLAYS)
def manifests(request: pytest.FixtureRequest) -> Manifests:
    return Manifests(request.param)
