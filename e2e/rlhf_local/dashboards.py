"""The chart's Grafana dashboards as data: their panels, queries and variables.

Shared by the dashboard linter (`tests/test_dashboards.py`), the e2e check that runs every query
on a real Prometheus (`e2e/tests/test_faults.py`) and the list of panels in
`docs/operations.md`, which ``python -m rlhf_local.dashboards write`` regenerates (``check``
fails when it is stale).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_local.paths import REPO_ROOT

DASHBOARD_DIR = REPO_ROOT / "charts" / "rlhfjob" / "dashboards"
LISTING_PAGE = REPO_ROOT / "docs" / "operations.md"
"""The page that lists every dashboard's panels and queries, between BEGIN and END."""
BEGIN = "<!-- dashboards: begin (python -m rlhf_local.dashboards write) -->"
END = "<!-- dashboards: end -->"
RATE_INTERVAL = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    expr: str

    def filled(self, variables: dict[str, str]) -> str:
        """The query as Grafana sends it: `$name` and `${name}` replaced by their values."""
        expr = self.expr
        for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $job
            expr = expr.replace("${" + name + "}", variables[name]).replace(
                "$" + name, variables[name]
            )
        return expr


def paths() -> list[Path]:
    return sorted(DASHBOARD_DIR.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside rows too."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queries(path: Path) -> list[Query]:
    dashboard = load(path)
    return [
        Query(dashboard["title"], panel["title"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variables(dashboard: dict[str, Any]) -> list[str]:
    return [variable["name"] for variable in dashboard.get("templating", {}).get("list", [])]


def listing() -> str:
    """Markdown: each dashboard's panels and their queries, as `LISTING_PAGE` shows them."""
    out = []
    for path in paths():
        dashboard = load(path)
        names = ", ".join(variables(dashboard))
        where = f"`{path.relative_to(REPO_ROOT)}`, uid `{dashboard['uid']}`"
        out.append(f"**{dashboard['title']}** ({where}; variables: {names})\n")
        out.append("| panel | unit | queries |")
        out.append("| --- | --- | --- |")
        for panel in panels(dashboard):
            if panel.get("type") == "row":
                continue
            exprs = "<br>".join(
                "`" + re.sub(r"\s+", " ", t["expr"]).replace("|", "\\|") + "`"
                for t in panel.get("targets", [])
            )
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
            out.append(f"| {panel['title']} | {unit} | {exprs} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def page_with_listing(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n\n" + listing() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    mode = (argv if argv is not None else sys.argv[1:]) or ["check"]
    text = LISTING_PAGE.read_text()
    wanted = page_with_listing(text)
    if mode == ["write"]:
        LISTING_PAGE.write_text(wanted)
        return 0
    if wanted != text:
        print("docs/operations.md's dashboard list is stale: python -m rlhf_local.dashboards write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
