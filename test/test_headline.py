"""The README's headline table is the committed regime sweep's output (docs/results/regimes.json),
cell for cell, with the commit and command it names; docs/pipeline.md's modes table is the
committed modes sweep's (docs/results/modes.json): the figures cannot drift from what was measured."""
from __future__ import annotations

import json
from pathlib import Path

from edgespec_ros.bench.regimes import HEADLINE_HEAD, HEADLINE_LINK, headline_rows

ROOT = Path(__file__).resolve().parents[1]


def markdown_table(text: str, after: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the first markdown table after the heading ``after``."""
    section = text[text.index(after):]
    lines = []
    for ln in section.splitlines()[1:]:
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:
            break
    rows = [[c.strip().strip("*").strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return rows[0], rows[2:]


def test_the_readme_headline_is_the_committed_regime_map():
    results = json.loads((ROOT / "docs" / "results" / "regimes.json").read_text())
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What it measures"):readme.index("## Repository map")]
    assert results["commit"] in section, "the README names the commit the sweep ran at"
    assert results["command"] in section, "the README gives the sweep's command"
    assert HEADLINE_LINK in section, "the README names the link its table shows"
    header, body = markdown_table(readme, "## What it measures")
    assert header == HEADLINE_HEAD
    assert body == headline_rows(results["rows"]), "the README's table is not the committed sweep's cells"
    assert len(body) >= 3


def test_the_pipeline_pages_modes_table_is_the_committed_modes_sweep():
    results = json.loads((ROOT / "docs" / "results" / "modes.json").read_text())
    page = (ROOT / "docs" / "pipeline.md").read_text()
    assert results["commit"] in page and results["command"] in page
    by = {(r["link"], r["mode"]): r for r in results["rows"]}
    block = page[page.index("link       mode      ms/token"):]
    block = block[:block.index("```")]
    seen = set()
    for line in block.splitlines()[2:]:
        link, mode, ms = line.split()[:3]
        assert float(ms) == round(by[(link, mode)]["ms_per_token"], 1), (link, mode)
        seen.add((link, mode))
    assert seen == set(by)
