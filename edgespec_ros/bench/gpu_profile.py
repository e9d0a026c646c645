"""edgespec-profile: measure the cloud half on the accelerator you have, for real-size Qwen2-VL.

Builds Qwen2-VL models of the published 2B and 7B shapes (``bench/shapes/*.json``: configuration
values only; random weights, no download) and measures, with this project's own verifier code
(``cloud.batch.verify_batch``, ``TargetSession``, ``ExitHooks``):

- the target's prefill of one 448x448 frame plus a prompt with a few decisions of history;
- a verification pass over block length 1..16 (tokens fed per robot: the pending token plus the
  drafts; 1 is the AR step) and batch rows 1..16, each robot at its own realistic KV length;
  the time of the model's forward alone is reported beside it (the rest is the host's share:
  stacking KV caches, logits to the host, the verification rule);
- the cost of each early-exit head (norm + LM head over the block, the host's check);
- the 2B's prefill and per-token drafting on the same device (a server-side proxy: an H100 is
  not an Orin, and the profile keeps the go2-paper Orin figures for the robot);
- peak accelerator memory;
- batch invariance: greedy SD with rounds verified alone and batched (2/4/8/16 sessions of
  different prompts joining and leaving) against the target decoding each prompt alone, token for
  token, in the precisions asked for; plus the logit differences behind any divergence.

It writes ``profile.json``, a compute profile that ``--compute FILE`` accepts (every benchmark,
the fleet sweep, the verifier, the demo): its cloud terms are the measured ones, its edge terms
the go2-paper Orin figures (labelled). ``measurements.json`` holds everything measured.

A separate tool (not an ``edgespec-bench`` sweep) because it must run on a bare GPU server with
only torch and transformers: it measures the model, not the system over a link, and imports
nothing of the wire, the simulator or ROS. Runs on CPU with ``--shapes tiny`` (the tests).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from ..robot.settings import DEFAULTS
from ..decoding.compute import GO2_PAPER, PROFILE_FORMAT
from .gpu_measure import (BLOCKS_DEFAULT, INVARIANCE_BATCHES, ROWS_DEFAULT, batch_invariance,
                          build_lm, device_state, load_shape, logit_deltas, measure_drafting,
                          measure_exits, measure_grid, measure_prefill, open_sessions, param_count,
                          synthetic_prompt, warm_device)


# --- the run ------------------------------------------------------------------------------------

@dataclass
class Plan:
    shapes: tuple = ("qwen2-vl-2b", "qwen2-vl-7b")
    device: str = "cuda"
    dtypes: tuple = ("bfloat16", "float32")  # the grid uses the first; invariance runs each
    rows: tuple = ROWS_DEFAULT
    blocks: tuple = BLOCKS_DEFAULT
    reps: int = 5
    image: int = 448
    text: int = 48
    history: int = 96
    exit_layers: tuple = (7, 14, 21)
    exit_rows: tuple = (1, 8)
    exit_block: int = 5
    draft_tokens: int = 24
    invariance_prompts: int = 16
    invariance_batches: tuple = INVARIANCE_BATCHES
    invariance_gamma: int = DEFAULTS.gamma
    invariance_tokens: int = 32
    invariance: bool = True
    passes: int = 1  # sweeps of the grid (round-robin over points: drift slows every point alike)
    warm_s: float = 0.0  # keep the accelerator busy this long before timing (clocks up)
    seed: int = 0


def environment(device: torch.device) -> dict:
    import transformers
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": str(device), "device_name": platform.processor() or platform.machine()}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    env["commit"] = _git_commit()
    return env


def _git_commit() -> str:
    """The commit measured: $EDGESPEC_COMMIT when set (a copy of the tree may carry a stale .git),
    else git's HEAD."""
    import subprocess
    if os.environ.get("EDGESPEC_COMMIT"):
        return os.environ["EDGESPEC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def run(plan: Plan, out_dir: str, progress=None) -> dict:
    """Measure everything in the plan, the profile's own figures first: the target in the first
    precision (prefill, the grid, exits; profile.json is written then), batch invariance in each
    precision, then the draft's shape (a server-side proxy). measurements.json is rewritten after
    every phase, so a run cut short keeps what it measured. Returns the measurements."""
    from ..decoding.engines import resolve_device
    device = resolve_device(plan.device)
    os.makedirs(out_dir, exist_ok=True)
    result = {"format": "edgespec-gpu-profile/1", "env": environment(device), "plan": plan.__dict__, "models": {}}
    target_shape = plan.shapes[-1]
    draft_shape = draft_key(plan.shapes)

    def save(profile: bool = False):
        _write_json(os.path.join(out_dir, "measurements.json"), result)
        if profile:
            _write_json(os.path.join(out_dir, "profile.json"), compute_profile(result, target_shape, draft_shape))

    def phase(name):
        print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)

    def bar(total, desc):
        return progress(total, desc) if progress else _NoBar()
    shape = load_shape(target_shape)
    entry = result["models"].setdefault(target_shape, {"params": param_count(shape), "invariance": {}})
    for k, dtype_name in enumerate(plan.dtypes):
        phase(f"{target_shape}: build ({dtype_name})")
        _peak_reset(device)
        lm = build_lm(shape, device, getattr(torch, dtype_name), plan.seed)
        cfg = lm.model.config
        prompts = [synthetic_prompt(cfg, plan.seed + 1 + i, plan.image, plan.text, plan.history + 8 * (i % 4))
                   for i in range(max(plan.invariance_prompts, max(plan.rows)))]
        sessions = open_sessions(lm, prompts[:max(plan.rows)])
        if k == 0:
            entry["dtype"] = dtype_name
            warm_device(device, plan.warm_s)
            entry.setdefault("device_state", []).append(("before grid", device_state(device)))
            phase(f"{target_shape} {dtype_name}: prefill")
            entry["prefill"] = measure_prefill(lm, prompts[0], plan.reps)
            phase(f"{target_shape} {dtype_name}: verification grid {len(plan.rows)} rows x {len(plan.blocks)} blocks")
            with bar(plan.passes * len(plan.rows) * len(plan.blocks), "grid") as b:
                entry["grid"] = measure_grid(lm, sessions, plan.rows, plan.blocks, plan.reps, plan.seed, b, plan.passes)
            entry["device_state"].append(("after grid", device_state(device)))
            save(profile=True)
            layers = [x for x in plan.exit_layers if 0 < x < cfg.text_config.num_hidden_layers]
            if layers:
                phase(f"{target_shape} {dtype_name}: early exits at layers {layers}")
                entry["exits"] = measure_exits(lm, sessions, layers, [r for r in plan.exit_rows if r <= len(sessions)],
                                               plan.exit_block, plan.reps, plan.seed)
                save(profile=True)
        else:  # the cost of verifying in this precision: the grid's corners
            entry.setdefault("precision_cost", {})[dtype_name] = measure_grid(
                lm, sessions, [plan.rows[0], plan.rows[-1]], [plan.exit_block], plan.reps, plan.seed)
        if not plan.invariance:
            entry.setdefault("peak_gib_by_dtype", {})[dtype_name] = _peak(device)
            del lm, sessions
            save()
            continue
        phase(f"{target_shape} {dtype_name}: batch invariance")
        with bar(plan.invariance_prompts + len(plan.invariance_batches), f"invariance {dtype_name}") as b:
            inv = batch_invariance(lm, prompts[:plan.invariance_prompts], plan.invariance_batches,
                                   plan.invariance_gamma, plan.invariance_tokens, plan.seed, b)
        inv["logits"] = logit_deltas(lm, sessions[:8], plan.exit_block, plan.seed)
        entry["invariance"][dtype_name] = inv
        entry.setdefault("peak_gib_by_dtype", {})[dtype_name] = _peak(device)
        del lm, sessions
        save()
    if draft_shape is not None:
        shape = load_shape(plan.shapes[0])
        dtype_name = plan.dtypes[0]
        phase(f"{draft_shape}: build ({dtype_name}), prefill, drafting (a server-side proxy)")
        _peak_reset(device)
        lm = build_lm(shape, device, getattr(torch, dtype_name), plan.seed)
        prompt = synthetic_prompt(lm.model.config, plan.seed, plan.image, plan.text, plan.history)
        warm_device(device, plan.warm_s)
        result["models"][draft_shape] = {
            "params": param_count(shape), "dtype": dtype_name, "prefill": measure_prefill(lm, prompt, plan.reps),
            "draft_token": measure_drafting(lm, prompt, plan.draft_tokens, plan.seed),
            "device_state": [("after drafting", device_state(device))]}
        result["models"][draft_shape]["peak_gib_by_dtype"] = {dtype_name: _peak(device)}
        del lm
        save(profile=True)
    phase(f"wrote {os.path.join(out_dir, 'profile.json')} and measurements.json")
    return result


def draft_key(shapes) -> str | None:
    """The draft's entry in the measurements (its shape's name; marked when it is the target's)."""
    if len(shapes) < 2:
        return None
    return shapes[0] if shapes[0] != shapes[-1] else f"{shapes[0]} (draft)"


def _write_json(path: str, obj) -> None:
    """Whole or not at all: a reader never sees a half-written file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class _NoBar:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def compute_profile(result: dict, target_shape: str, draft_shape: str | None) -> dict:
    """The compute profile (decoding.compute.ComputeProfile.from_dict) from the measurements: the
    cloud's terms measured, the robot's the go2-paper Orin figures."""
    env = result["env"]
    target = result["models"][target_shape]
    grid = target["grid"]
    rows = sorted({g["rows"] for g in grid})
    blocks = sorted({g["block"] for g in grid})
    at = {(g["rows"], g["block"]): point_s(g) for g in grid}
    table = [[at[(r, b)] for b in blocks] for r in rows]
    device_tag = env["device_name"].replace("NVIDIA ", "").split()[0].lower() if env["device"].startswith("cuda") \
        else "cpu"
    name = f"{device_tag}-{target_shape}-{target['dtype']}"
    gamma4 = at.get((1, 5), table[0][min(len(blocks) - 1, 4)])
    return {
        "format": PROFILE_FORMAT, "name": name,
        "source": (f"measured by edgespec-profile on {env['device_name']} ({env['device']}), torch {env['torch']}, "
                   f"transformers {env['transformers']}, commit {env['commit'] or '?'}: {target_shape} "
                   f"(random weights, {target['dtype']})"
                   + (f", {len(result['combined_from'])} runs combined (each point its quietest pass)"
                      if result.get("combined_from") else "") + "; the robot's terms are the go2-paper Orin figures"),
        "verify_s": gamma4, "ar_step_s": at.get((1, 1), table[0][0]),
        "exit_s": target.get("exits", {}).get("exit_s", 0.0),
        "prefill_s": target["prefill"]["s"],
        "verify_table": {"rows": rows, "blocks": blocks, "s": table},
        "draft_token_s": GO2_PAPER.draft_token_s, "edge_prefill_s": GO2_PAPER.edge_prefill_s,
        "edge_source": GO2_PAPER.edge_source,
        "server_proxy": ({"model": draft_shape, "draft_token_s": result["models"][draft_shape]["draft_token"]["s"],
                          "prefill_s": result["models"][draft_shape]["prefill"]["s"],
                          "note": "the draft model on the server's device: not a robot figure"}
                         if draft_shape and "draft_token" in result["models"].get(draft_shape, {}) else None),
    }


def point_s(g: dict) -> float:
    """A grid point's figure for the profile: the median of its quietest pass. A slow phase of a
    shared machine (clocks, a neighbour, the host) slows every point measured inside it, and noise
    only ever adds time, so the quietest pass is the machine's own cost; ``s`` (the median of every
    sample) stays in the measurements beside it. Files without per-pass medians give ``s``."""
    passes = g.get("pass_s") or []
    return min(passes) if passes else g["s"]


def point_forward_s(g: dict) -> float:
    """The model's forward alone in the pass ``point_s`` took (the run's median where it kept none
    per pass)."""
    passes, forwards = g.get("pass_s") or [], g.get("pass_forward_s") or []
    if passes and len(forwards) == len(passes):
        return forwards[min(range(len(passes)), key=passes.__getitem__)]
    return g["forward_s"]


def combine(results: list[dict], names: list[str] | None = None) -> dict:
    """Several runs' measurements (same device, target shape and precision) as one: each grid point
    keeps every run's passes (``pass_s``; derived from ``all_s`` and the run's reps for older files)
    and samples, so ``point_s`` takes the quietest pass of all (its forward beside it); the prefill
    is the quietest run's; exits, invariance, precision cost and the draft's figures come from the
    first run that has them. Runs of different devices, targets or precisions are refused."""
    from .gpu_measure import pass_medians
    if not results:
        raise ValueError("combine: no measurements")
    first = results[0]
    target = first["plan"]["shapes"][-1]
    key = lambda r: (r["env"]["device_name"], r["plan"]["shapes"][-1], r["models"][target].get("dtype"))  # noqa: E731
    for r in results[1:]:
        if target not in r["models"] or key(r) != key(first):
            raise ValueError(f"combine: {key(r)} is not {key(first)}: runs of one device, target and precision only")
    merged = json.loads(json.dumps(first))
    entry = merged["models"][target]
    points: dict = {}
    for r in results:
        reps = r["plan"]["reps"]
        for g in r["models"][target].get("grid", []):
            p = points.setdefault((g["rows"], g["block"]), {"rows": g["rows"], "block": g["block"], "all_s": [],
                                                             "pass_s": [], "pass_forward_s": [], "kv_min": g["kv_min"],
                                                             "kv_max": g["kv_max"]})
            passes = g.get("pass_s") or pass_medians(g["all_s"], reps)
            p["all_s"] += g["all_s"]
            p["pass_s"] += passes
            # per pass where the run kept it, else the run's median forward for each of its passes
            p["pass_forward_s"] += g.get("pass_forward_s") or [g["forward_s"]] * len(passes)
    entry["grid"] = []
    for _, p in sorted(points.items()):
        entry["grid"].append({"rows": p["rows"], "block": p["block"], "s": float(statistics.median(p["all_s"])),
                              "kv_min": p["kv_min"], "kv_max": p["kv_max"], "all_s": p["all_s"],
                              "pass_s": p["pass_s"], "pass_forward_s": p["pass_forward_s"]})
        entry["grid"][-1]["forward_s"] = point_forward_s(entry["grid"][-1])
    models = [r["models"][target] for r in results]
    entry["prefill"] = min((m["prefill"] for m in models if "prefill" in m), key=lambda x: x["s"])
    for k in ("exits", "invariance", "precision_cost"):
        entry[k] = next((m[k] for m in models if m.get(k)), entry.get(k, {}))
    for r in results:
        for name, m in r["models"].items():
            if name != target and name not in merged["models"]:
                merged["models"][name] = m
    merged["env"]["commit"] = ",".join(dict.fromkeys(r["env"].get("commit") or "?" for r in results))
    merged["combined_from"] = [{"name": n, "commit": r["env"].get("commit"), "plan": r["plan"]}
                               for n, r in zip(names or [f"run {i + 1}" for i in range(len(results))], results)]
    return merged


def format_report(result: dict) -> str:
    """The measurements as text tables."""
    env = result["env"]
    lines = [f"edgespec-profile on {env['device_name']} ({env['device']}), torch {env['torch']}, "
             f"transformers {env['transformers']}, commit {env.get('commit') or '?'}; random weights"]
    for name, m in result["models"].items():
        lines.append(f"\n## {name}: {m['params'] / 1e9:.2f} B parameters, {m.get('dtype', '?')}")
        if "prefill" in m:
            p = m["prefill"]
            lines.append(f"prefill {p['tokens']} tokens ({p['image_tokens']} image): {p['s'] * 1e3:.1f} ms")
        if "draft_token" in m:
            lines.append(f"drafting: {m['draft_token']['s'] * 1e3:.1f} ms/token (server-side proxy, not a robot figure)")
        if m.get("grid"):
            blocks = sorted({g["block"] for g in m["grid"]})
            rows = sorted({g["rows"] for g in m["grid"]})
            at = {(g["rows"], g["block"]): g for g in m["grid"]}
            lines.append("verification pass, ms: the quietest pass's median (model forward alone in brackets); "
                         "block = tokens fed per robot")
            lines.append("rows \\ block " + "".join(f"{b:>14}" for b in blocks))
            for r in rows:
                lines.append(f"{r:>12} " + "".join(f"{point_s(at[(r, b)]) * 1e3:>7.1f} "
                                                    f"({point_forward_s(at[(r, b)]) * 1e3:>4.1f})" for b in blocks))
            one = point_s(at[(rows[0], blocks[0])])
            lines.append(f"batch of {rows[-1]} at block {blocks[-1]}: {point_s(at[(rows[-1], blocks[-1])]) / one:.2f}x "
                         f"a lone AR step")
            if (1, 5) in at and (rows[-1], 5) in at:
                lines.append(f"batch of {rows[-1]} at block 5 (gamma 4): "
                             f"{point_s(at[(rows[-1], 5)]) / point_s(at[(1, 5)]):.2f}x a lone pass")
        if m.get("exits"):
            e = m["exits"]
            lines.append(f"early exits at layers {e['layers']}: {e['exit_s'] * 1e3:.2f} ms per exit per session "
                         + ", ".join(f"rows {r['rows']}: {r['plain_s'] * 1e3:.1f} -> {r['with_exits_s'] * 1e3:.1f} ms"
                                     for r in e["rows"]))
        for dtype, inv in m.get("invariance", {}).items():
            lines.append(f"batch invariance, {dtype}, greedy SD gamma {inv['gamma']} vs the target alone "
                         f"(margin top1-top2: median {inv['margin']['median']:.3g}, min {inv['margin']['min']:.3g}):")
            for run_ in inv["runs"]:
                label = "alone (block only)" if run_["batch"] == 1 else f"batched <= {run_['batch']}"
                lines.append(f"  {label:<20} divergent {run_['divergent']}/{run_['decisions']} decisions"
                             + (f", first at positions {run_['first_divergent_positions']}" if run_["divergent"] else ""))
            lg = inv.get("logits")
            if lg:
                lines.append(f"  logits batched vs alone ({lg['rows']} rows x {lg['block']}): max |delta| "
                             f"{lg['max_abs_delta']:.3g} (logit std {lg['logit_std']:.3g}), argmax flips "
                             f"{lg['argmax_flips']}/{lg['positions']}")
        for dtype, corner in m.get("precision_cost", {}).items():
            lines.append(f"{dtype} verification: " + ", ".join(f"rows {c['rows']} block {c['block']}: {c['s'] * 1e3:.1f} ms"
                                                             for c in corner))
        for when, st in m.get("device_state", []):
            lines.append(f"device state {when}: host loop {st['host_loop_ms']:.1f} ms, torch threads {st['torch_threads']}"
                         + (f", matmul {st['matmul_tflops']:.0f} TFLOP/s, 1000 launches {st['launch_us']:.1f} ms, "
                            f"clocks/util/power {st.get('clocks', '?')}" if "matmul_tflops" in st else ""))
        peaks = {k: v for k, v in m.get("peak_gib_by_dtype", {}).items() if v is not None}
        if peaks:
            lines.append("peak accelerator memory: " + ", ".join(f"{k} {v:.1f} GiB" for k, v in peaks.items()))
    return "\n".join(lines)


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen2-vl-2b,qwen2-vl-7b",
                    help="draft,target model shapes (bench/shapes/*.json or paths); one name: the target only "
                         "(default qwen2-vl-2b,qwen2-vl-7b; tiny for a CPU smoke run)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--dtypes", default="bfloat16,float32",
                    help="precisions; the first is timed over the grid, each is checked for batch invariance "
                         "(default bfloat16,float32)")
    ap.add_argument("--rows", type=_ints, default=ROWS_DEFAULT, help="batch rows (robots) measured")
    ap.add_argument("--blocks", type=_ints, default=BLOCKS_DEFAULT,
                    help="block lengths measured: tokens fed per robot (pending + drafts; 1 = AR step)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median; default 5)")
    ap.add_argument("--invariance-prompts", type=int, default=16)
    ap.add_argument("--invariance-tokens", type=int, default=32)
    ap.add_argument("--passes", type=int, default=2,
                    help="sweeps of the grid, round-robin over its points (default 2; drift slows every point alike)")
    ap.add_argument("--warm-s", type=float, default=5.0,
                    help="keep the accelerator busy this many seconds before timing (default 5)")
    ap.add_argument("--no-invariance", dest="invariance", action="store_false",
                    help="skip the batch-invariance check (timing only)")
    ap.add_argument("--out", default="out/gpu-profile", help="folder for profile.json and measurements.json")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few points, few tokens")
    ap.add_argument("--combine", nargs="+", metavar="MEASUREMENTS",
                    help="measure nothing: combine these runs' measurements.json (one device, target and "
                         "precision) into one profile in --out, each grid point from the quietest pass of all")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.combine:
        return _combine_main(args.combine, args.out)
    from tqdm import tqdm
    shapes = tuple(s for s in args.shapes.split(",") if s)
    if not 1 <= len(shapes) <= 2:
        raise SystemExit("edgespec-profile: --shapes takes a target, or a draft and a target")
    plan = Plan(shapes=shapes, device=args.device, dtypes=tuple(d for d in args.dtypes.split(",") if d),
                rows=tuple(sorted(set(args.rows))), blocks=tuple(sorted(set(args.blocks))), reps=args.reps,
                invariance_prompts=args.invariance_prompts, invariance_tokens=args.invariance_tokens,
                invariance=args.invariance, passes=args.passes, warm_s=args.warm_s)
    for d in plan.dtypes:
        if not isinstance(getattr(torch, d, None), torch.dtype):
            raise SystemExit(f"edgespec-profile: unknown dtype {d!r} (bfloat16, float16, float32)")
    if plan.rows[0] < 1 or plan.blocks[0] < 1 or plan.reps < 1:
        raise SystemExit("edgespec-profile: rows, blocks and reps must be >= 1")
    if args.quick:
        plan.rows, plan.blocks, plan.reps, plan.passes, plan.warm_s = plan.rows[:2], plan.blocks[:3], 2, 1, 0.0
        plan.invariance_prompts, plan.invariance_batches, plan.invariance_tokens = 4, (1, 2, 4), 8
        plan.draft_tokens = 4
    if shapes == ("tiny",) or "tiny" in shapes:
        plan.image, plan.text, plan.history, plan.exit_layers = 56, 8, 8, (1, 2)
    def progress(total, desc):
        return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, mininterval=2.0)
    result = run(plan, args.out, progress)
    print(format_report(result))
    return 0



def _combine_main(paths: list[str], out_dir: str) -> int:
    results = []
    for path in paths:
        try:
            with open(path) as f:
                results.append(json.load(f))
        except (OSError, ValueError) as e:
            raise SystemExit(f"edgespec-profile: cannot read {path}: {e}") from None
    try:
        merged = combine(results, [os.path.basename(os.path.dirname(os.path.abspath(p))) + "/" + os.path.basename(p)
                                   for p in paths])
    except (ValueError, KeyError) as e:
        raise SystemExit(f"edgespec-profile: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    target = merged["plan"]["shapes"][-1]
    _write_json(os.path.join(out_dir, "measurements.json"), merged)
    _write_json(os.path.join(out_dir, "profile.json"), compute_profile(merged, target, draft_key(merged["plan"]["shapes"])))
    print(format_report(merged))
    print(f"combined {len(results)} runs into {os.path.join(out_dir, 'profile.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
