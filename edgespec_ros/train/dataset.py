"""The data stage's dataset (``<work>/dataset.npz``): where it is and what it holds (the examples,
their earlier decisions, the prompt format and the expert its frames were labelled with)."""
from __future__ import annotations

import json
import os

import numpy as np


def dataset_path(work: str) -> str:
    """The data stage's dataset.npz in ``work``; a clear error when the stage has not run."""
    path = os.path.join(work, "dataset.npz")
    if not os.path.isfile(path):
        raise SystemExit(f"edgespec-train: {path} not found: run `edgespec-train data --work {work}` first")
    return path


def load_dataset(work: str):
    from ..sim.dataset import DenseLabels, Example
    d = np.load(dataset_path(work))
    if "present" in d:
        goal = d["goal_class"] if "goal_class" in d else np.full(len(d["texts"]), -1)
        labels = [DenseLabels(p, z, int(g)) for p, z, g in zip(d["present"], d["log_depth"], goal)]
    else:  # a dataset written before dense labels existed
        labels = [None] * len(d["texts"])
    histories = dataset_histories(d)
    return [Example(img, str(i), str(t), lab, h)
            for img, i, t, lab, h in zip(d["images"], d["instructions"], d["texts"], labels, histories)]


def dataset_histories(d) -> list[tuple]:
    """Each example's earlier decisions (``decoding.memory.Turn``) in an open dataset file."""
    from ..decoding.memory import Turn
    if "history" not in d:  # written before the memory design: memoryless
        return [()] * len(d["texts"])
    return [tuple(Turn(*t) for t in json.loads(str(h))) for h in d["history"]]


def dataset_memory(work: str) -> int:
    """The ``memory`` the data stage in ``work`` was generated with (0 for older datasets)."""
    d = np.load(dataset_path(work))
    return int(d["memory"]) if "memory" in d else 0


def dataset_prompt(work: str):
    """The ``decoding.memory.PromptFormat`` (memory, belief) the data stage in ``work`` was generated
    with (older datasets: no belief)."""
    from ..decoding.memory import PromptFormat
    d = np.load(dataset_path(work))
    return PromptFormat(int(d["memory"]) if "memory" in d else 0, bool(d["belief"]) if "belief" in d else False)


def dataset_expert(work: str) -> dict:
    """The expert settings (``sim.expert.expert_overrides``) the data stage in ``work`` labelled
    its frames with ({} for the default expert and older datasets)."""
    d = np.load(dataset_path(work))
    return json.loads(str(d["expert"])) if "expert" in d else {}
