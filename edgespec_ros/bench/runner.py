"""Side-by-side runs of decoding modes over a real websocket through an emulated link.

The verifier runs as its own process (``python -m edgespec_ros.cloud.cli``), as it would in
the cloud; the edge (drafter + client) runs here; a LinkProxy on loopback shapes the traffic.
Used by ``edgespec-bench`` and ``edgespec-demo``.
"""
from __future__ import annotations

import contextlib
import os
import time
import urllib.request

import numpy as np

from ..models import ModelPair
from ..processes import verifier_process
from ..robot.decoder import EdgeDecoder
from ..robot.settings import DEFAULTS, DecodeConfig
from ..decoding.engines import LoadedModel, load_model
from ..decoding.metrics import RunSummary
from ..decoding.memory import PromptFormat
from ..decoding.sampling import SamplingParams
from ..wire.client import RemoteVerifier
from ..decoding.compute import ComputeProfile
from ..wire.link import LinkProxy, get_profile


def bench_prompts(n: int, seed: int = 0, prompt: PromptFormat = PromptFormat()) -> list[tuple]:
    """(instruction, camera image) pairs: first frames of held-out simulated scenarios. A
    ``prompt`` with memory: (instruction, image, history) triples instead, the consecutive decisions
    of held-out expert rollouts as a policy with that much memory is prompted (``decoding.memory``):
    each prompt extends the last one of its episode, which the verifier's prefix reuse serves from
    its cache; with ``prompt.belief`` their last turns carry the search belief (``control.belief``)."""
    try:
        from ..sim.dataset import expert_frames, heldout_prompts
    except ImportError:  # the simulator is optional for the bench: fall back to plain images
        rng = np.random.default_rng(seed)
        return [("find the silver bottle", rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)) for _ in range(n)]
    if prompt.memory:
        from itertools import islice
        frames = expert_frames("heldout", max(1, n), seed, perturbations_per_step=0, prompt=prompt)
        return [(f.scenario.instruction, f.view.rgb, f.history) for f in islice(frames, n)]
    return heldout_prompts(n, seed)


def prompt_parts(prompt) -> tuple:
    """(instruction, image, history) of one benchmark prompt: an (instruction, image) pair, or the
    (instruction, image, history) triple of a policy with memory (``bench_prompts(prompt=)``,
    ``bags.BagReplay.with_memory``); history () for a pair."""
    instruction, image, *rest = prompt
    return instruction, image, (rest[0] if rest else ())


TREE_MODES = ("sd", "pipe", "auto")  # the modes that draft token trees (DecodeConfig.tree_shape)


def trees_for(mode: str, trees) -> tuple[str, ...]:
    """The tree settings a mode is run with: sd and pipe every one; auto (which plans the depth)
    "none" and "auto" among them; the others none."""
    if mode == "auto":
        return tuple(t for t in trees if t in ("none", "auto")) or ("none",)
    return tuple(trees) if mode in TREE_MODES else ("none",)


def run_modes(draft_lm: LoadedModel, url: str, modes: list[str], prompts, *, link: str, compute: ComputeProfile,
              gamma: int | str = DEFAULTS.gamma, max_new_tokens: int = DEFAULTS.max_new_tokens,
              params: SamplingParams = SamplingParams(DEFAULTS.temperature), seed: int = DEFAULTS.seed,
              codec: str = DEFAULTS.codec, token: str = "", on_decision=None, warmup: int = 0,
              workers: int = DEFAULTS.predraft_workers, client_queue: str = DEFAULTS.client_queue,
              pipe_depth: int | str = DEFAULTS.pipe_depth,
              pipe_truncate: bool = True, pipe_fill_rows: bool = True,
              trees: tuple[str, ...] = ("none",), tree_nodes: int = DEFAULTS.tree_nodes) -> dict[str, RunSummary]:
    """Decode every prompt in every mode (same seeds); returns a RunSummary per mode (once per tree
    setting the mode takes, ``trees_for``: "none" is chains, labelled by the mode; a tree shape
    ``MODE tree=SHAPE``).

    The first ``warmup`` prompts of each mode are decoded on the same decoder but not summarized
    (gamma "auto" learns its estimates; on_decision still sees them, with their index i < warmup).
    workers and client_queue set fsd's pre-drafting; pipe_depth the pipe modes' blocks in flight and
    pipe_truncate their latency-aware truncation, pipe_fill_rows their gamma + 1 drafts where a pass
    feeds no pending token."""
    if compute.cloud_only and any(m != "ar" for m in modes):
        raise ValueError(f"compute profile {compute.name!r} is a production engine's published figure (LITERATURE): "
                         "it verifies no robot's drafts, so only mode ar runs on it")
    profile = get_profile(link)
    summaries = {}
    for mode, tree in [(m, t) for m in modes for t in trees_for(m, trees)]:
        label = mode if tree == "none" else f"{mode} tree={tree}"
        summary = RunSummary(mode=label, link=link, compute=compute.name)
        verifier = RemoteVerifier(url, fingerprint=draft_lm.fingerprint(), vocab_size=draft_lm.vocab_size,
                                  token=token, codec=codec, link_profile=profile, timeout_s=60.0,
                                  prompt_format=draft_lm.prompt_format)
        with verifier:
            decoder = EdgeDecoder(draft_lm, verifier, draft_compute=compute)
            for i, prompt in enumerate(prompts):
                instruction, image, history = prompt_parts(prompt)
                auto = mode == "auto"  # mode auto chooses the draft length and the depth too
                cfg = DecodeConfig(mode=mode, gamma="auto" if auto else gamma, max_new_tokens=max_new_tokens, params=params,
                                   seed=seed + i, codec=codec, workers=workers, client_queue=client_queue,
                                   pipe_depth="auto" if auto else pipe_depth, pipe_truncate=pipe_truncate,
                                   pipe_fill_rows=pipe_fill_rows, tree=tree, tree_nodes=tree_nodes)
                decision = decoder.decide(instruction, image, cfg, history=history)
                if i >= warmup:
                    summary.add(decision.metrics)
                if on_decision:
                    on_decision(label, i, instruction, decision)
            decoder.close()
        summaries[label] = summary
    return summaries


@contextlib.contextmanager
def emulated_setup(pair: ModelPair, link: str, compute: str, exit_queue: str = "priority", exits: str = "auto",
                   metrics_out: str | None = None, verifier_args: tuple[str, ...] = ()):
    """Verifier process + link proxy; yields (draft LoadedModel, proxy url). ``metrics_out``: the
    verifier's /metrics as it stands at the end, written to that file; ``verifier_args``: more
    edgespec-verifier options (e.g. --no-prefix-reuse)."""
    draft_lm = load_model(pair.draft_path)
    with verifier_process(pair.target_path, compute, exit_queue=exit_queue, exits=exits,
                          extra_args=tuple(verifier_args)) as port:
        with LinkProxy(get_profile(link), "127.0.0.1", port) as proxy:
            yield draft_lm, proxy.url
        if metrics_out:
            time.sleep(0.2)  # the last session's end is counted when the verifier sees the close
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            os.makedirs(os.path.dirname(os.path.abspath(metrics_out)), exist_ok=True)
            with open(metrics_out, "wb") as f:
                f.write(text)
            print(f"wrote {metrics_out} (the verifier's /metrics)")


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup_vs_<mode> = that mode's ms/token divided by this row's, for ar and sd rows present."""
    by_mode = {r["mode"]: r for r in rows}
    for r in rows:
        for ref in ("ar", "sd"):
            base = by_mode.get(ref)
            if base and base["ms_per_token"] and r["ms_per_token"]:
                r[f"speedup_vs_{ref}"] = base["ms_per_token"] / r["ms_per_token"]
    return rows


def _times(value) -> str:
    """A speedup as "1.23x", or "-" when the reference mode was not run."""
    return "-" if value is None or value != value else f"{value:.2f}x"


def _codec_label(row: dict) -> str:
    """The row's codec, marked LOSSY where its decisions can differ from the target's."""
    if not row.get("codec"):
        return "-"
    from ..codecs import get_codec
    return get_codec(row["codec"]).label(row.get("temperature"))


def format_table(rows: list[dict], emulated: bool) -> str:
    """A fixed-width table of bench rows (emulated compute is labelled)."""
    head = ["mode", "link", "compute", "codec", "gamma", "decisions", "tokens", "rounds", "tau", "accept",
            "resample", "ms/token", "ms/decision", "prompt tok", "cloud prefill ms", "up B/draft tok", "x vs AR", "x vs SD", "cache miss", "avg exit",
            "in flight", "flushes", "truncated", "cloud idle ms/tok"]
    lines = []
    for r in rows:
        acc = r["acceptance_rate"]
        lines.append([
            r["mode"], r["link"], r["compute"] + (" (emulated)" if emulated else ""),
            _codec_label(r) if r["mode"] != "ar" else "-", str(r["gamma"] or "-"),
            str(r["decisions"]), str(r["tokens"]), str(r["rounds"]), f"{r['tau']:.2f}",
            "-" if acc is None else f"{acc:.3f}",
            "-" if r.get("resampling_rate") is None else f"{r['resampling_rate']:.2f}",
            f"{r['ms_per_token']:.1f}", f"{r['ms_per_decision']:.0f}",
            "-" if r.get("prompt_tokens_mean") is None else f"{r['prompt_tokens_mean']:.0f}",
            "-" if not r.get("cloud_prefill_ms_mean") else f"{r['cloud_prefill_ms_mean']:.1f}",
            "-" if r["uplink_bytes_per_draft_token"] is None else f"{r['uplink_bytes_per_draft_token']:.0f}",
            _times(r.get("speedup_vs_ar")), _times(r.get("speedup_vs_sd")),
            "-" if r.get("cache_miss_rate") is None else f"{100 * r['cache_miss_rate']:.1f}%",
            "-" if r.get("avg_exit_layer") is None else f"{r['avg_exit_layer']:.1f}",
            "-" if r.get("max_in_flight") is None else f"{r['max_in_flight']}/{r['pipe_depth']}",
            "-" if r.get("pipe_flushes") is None else str(r["pipe_flushes"]),
            "-" if r.get("pipe_flushes") is None else str(r.get("pipe_truncations", 0)),
            "-" if r.get("cloud_idle_ms_per_token") is None else f"{r['cloud_idle_ms_per_token']:.1f}"])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)
