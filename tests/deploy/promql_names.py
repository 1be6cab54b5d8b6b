"""The dashboard's PromQL expressions and the metric names they use (for tests/deploy)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "coliworker.json"

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "inf", "nan",
}  # fmt: skip
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the panels (rows included) and of the query variables."""
    exprs: list[str] = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana label_values() variable query)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,.*\)\s*", expr)
    if m:
        return {m.group(1)}
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in _IDENT.finditer(text):
        word, end = match.group(0), match.end()
        if word.lower() in _KEYWORDS or text[end:].lstrip().startswith("("):
            continue  # a keyword or a function call
        if match.start() > 0 and (
            text[match.start() - 1].isdigit() or text[match.start() - 1] == "."
        ):
            continue  # the exponent of a number such as 1e-9
        names.add(word)
    return names
