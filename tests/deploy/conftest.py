"""Fixtures of the deployment tests."""

from __future__ import annotations

import json

import pytest
from promql_names import DASHBOARD, dashboard_queries


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="session")
def dashboard_exprs(dashboard: dict) -> list[str]:
    return dashboard_queries(dashboard)
