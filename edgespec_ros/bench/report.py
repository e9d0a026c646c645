"""Report helpers every sweep shares: fixed-width text tables, number formatting, and plots
written with matplotlib's file backend. Sweep modules import these, never the registry
(``bench.sweeps``), which imports them."""
from __future__ import annotations

import math
import os


def fixed_width(head: list[str], lines: list[list[str]]) -> str:
    """A left-aligned text table."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
