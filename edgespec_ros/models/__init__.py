"""The embedded default models (draft and target), installed with the package.

``make models`` (edgespec-train all) writes them here; until they exist the demo falls back to an
untrained in-memory pair and says so.
"""
from __future__ import annotations

import os

ROLES = ("draft", "target")
MODELS_DIR = os.path.dirname(os.path.abspath(__file__))


def default_model_path(role: str) -> str:
    """Directory of the embedded default model for role 'draft' or 'target' (may not exist yet)."""
    if role not in ROLES:
        raise ValueError(f"model role must be one of {ROLES}, got {role!r}")
    return os.path.join(MODELS_DIR, role)


def have_default_models() -> bool:
    return all(os.path.isfile(os.path.join(default_model_path(r), "config.json")) for r in ROLES)
