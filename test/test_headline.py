"""The README's headline table is the committed modes sweep's output (docs/results/modes.json),
cell for cell, with the commit and command it names: the figures cannot drift from what was measured."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = {"AR ms/token": "ar", "SD": "sd", "FSD": "fsd", "pipe": "pipe", "pipe+fsd": "pipe+fsd"}


def headline_table(readme: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of the README's headline table (the one under 'What it measures')."""
    section = readme[readme.index("## What it measures"):]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    rows = [[c.strip().strip("*") for c in ln.strip("|").split("|")] for ln in lines]
    header, body = rows[0], [r for r in rows[2:] if r and r[0]]
    end = next((i for i, r in enumerate(body) if not re.match(r"^[\d.]+$", r[1] or "x")), len(body))
    return header, body[:end]


def test_the_readme_headline_is_the_committed_sweep():
    results = json.loads((ROOT / "docs" / "results" / "modes.json").read_text())
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What it measures"):]
    assert results["commit"] in section, "the README names the commit the sweep ran at"
    assert results["command"] in section, "the README gives the sweep's command"
    header, body = headline_table(readme)
    by = {(r["link"], r["mode"]): r for r in results["rows"]}
    links = {r["link"] for r in results["rows"]}
    assert {row[0] for row in body} == links
    for row in body:
        cells = dict(zip(header, row))
        for column, mode in COLUMNS.items():
            assert float(cells[column]) == round(by[(row[0], mode)]["ms_per_token"], 1), (row[0], mode)
        best = min(by[(row[0], m)]["ms_per_token"] for m in COLUMNS.values() if m != "ar")
        assert cells["AR -> best"] == f"{by[(row[0], 'ar')]['ms_per_token'] / best:.2f}x", row[0]
