"""The embedded default models (draft and target), installed with the package.

``make models`` (edgespec-train all) writes them here; until they exist the demo falls back to an
untrained in-memory pair and says so.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

ROLES = ("draft", "target")
MODELS_DIR = os.path.dirname(os.path.abspath(__file__))


def default_model_path(role: str) -> str:
    """Directory of the embedded default model for role 'draft' or 'target' (may not exist yet)."""
    if role not in ROLES:
        raise ValueError(f"model role must be one of {ROLES}, got {role!r}")
    return os.path.join(MODELS_DIR, role)


def have_default_models() -> bool:
    return all(os.path.isfile(os.path.join(default_model_path(r), "config.json")) for r in ROLES)


@dataclass
class ModelPair:
    draft_path: str
    target_path: str
    label: str  # shown to the user: which models these are
    _tmp: object = field(default=None, repr=False)


def resolve_models(draft: str | None, target: str | None) -> ModelPair:
    """Given paths, or the embedded defaults, or (before `make models`) an untrained pair."""
    if draft and target:
        return ModelPair(draft, target, f"draft {draft}, target {target}")
    if have_default_models():
        return ModelPair(draft or default_model_path("draft"), target or default_model_path("target"),
                         "embedded default models (edgespec_ros/models)")
    tmp = tempfile.TemporaryDirectory(prefix="edgespec-untrained-")
    from .tiny import write_untrained_pair
    d, t = write_untrained_pair(tmp.name)
    return ModelPair(draft or d, target or t, "UNTRAINED random pair (run `make models` to train the real defaults)",
                     tmp)
