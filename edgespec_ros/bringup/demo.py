"""edgespec-demo: the closed loop (default) or the one-frame AR vs SD comparison (--compare).

    edgespec-demo [--scenario S] [--mode M] [--link L] ...   the closed loop: edgespec_ros.bringup
    edgespec-demo --compare [--link L] [--compute C] ...     one camera frame + instruction decoded by
                                                             cloud AR and by edge-cloud SD, side by side

Both run the verifier as a separate process behind an emulated link.
"""
from __future__ import annotations

import argparse
import sys
import textwrap

from ..models import resolve_models
from ..processes import env_threads
from ..bench.runner import add_speedups, bench_prompts, emulated_setup, run_modes
from ..decoding.compute import compute_arg, compute_help, get_compute
from ..decoding.sampling import SamplingParams
from ..wire.link import PROFILES
from ..robot.settings import DEFAULTS


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-demo --compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--link", default="wifi-poor", choices=list(PROFILES), help="emulated link (default wifi-poor)")
    ap.add_argument("--compute", default="native", type=compute_arg,
                    help=f"the verifier's compute: {compute_help()} (default native)")
    ap.add_argument("--gamma", type=int, default=DEFAULTS.gamma, help=f"draft length (default {DEFAULTS.gamma})")
    ap.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    ap.add_argument("--seed", type=int, default=0, help="which held-out scene to decode")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--target", default=None)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        argv.remove("--compare")
        return compare(argv)
    from .closed_loop import main as closed_loop
    if argv in (["-h"], ["--help"]):
        print("edgespec-demo: the closed loop (below); `edgespec-demo --compare --help` for the one-frame AR vs SD "
              "comparison.\n")
    return closed_loop(argv)


def compare(argv=None) -> int:
    """One frame decoded by cloud AR and by edge-cloud SD; returns 1 if greedy outputs differ."""
    args = build_parser().parse_args(argv)
    env_threads()
    compute = get_compute(args.compute)
    pair = resolve_models(args.draft, args.target)
    prompts = bench_prompts(1, args.seed)
    instruction = prompts[0][0]
    print(f"edgespec demo: one decision, cloud AR vs edge-cloud SD\n"
          f"  models : {pair.label}\n  link   : {PROFILES[args.link].describe()}\n"
          f"  compute: {compute.name}{' (emulated)' if compute.emulated else ''}\n"
          f"  prompt : {instruction!r} + {prompts[0][1].shape[1]}x{prompts[0][1].shape[0]} camera frame\n")
    texts = {}

    def on_decision(mode, _i, _instr, decision):
        texts[mode] = decision.text
        print(f"  [{mode}] done: {decision.metrics.tokens} tokens in {decision.metrics.wall_s * 1e3:.0f} ms")

    with emulated_setup(pair, args.link, args.compute) as (draft_lm, url):
        summaries = run_modes(draft_lm, url, ["ar", "sd"], prompts, link=args.link, compute=compute, gamma=args.gamma,
                              max_new_tokens=args.max_new_tokens, params=SamplingParams(args.temperature),
                              seed=args.seed, on_decision=on_decision)
    rows = add_speedups([summaries[m].row() for m in ("ar", "sd")])
    ar, sd = rows
    same = texts["ar"] == texts["sd"]
    print()
    col = 34
    lines = [("", "cloud AR", "edge-cloud SD"),
             ("tokens", ar["tokens"], sd["tokens"]),
             ("rounds (link round trips)", ar["rounds"], sd["rounds"]),
             ("tau (tokens / round)", f"{ar['tau']:.2f}", f"{sd['tau']:.2f}"),
             ("draft acceptance", "-", f"{sd['acceptance_rate']:.3f}"),
             ("ms / token", f"{ar['ms_per_token']:.1f}", f"{sd['ms_per_token']:.1f}"),
             ("ms / decision", f"{ar['ms_per_decision']:.0f}", f"{sd['ms_per_decision']:.0f}"),
             ("uplink bytes", ar["uplink_bytes"], sd["uplink_bytes"]),
             ("downlink bytes", ar["downlink_bytes"], sd["downlink_bytes"]),
             ("speedup vs AR", "1.00x", f"{sd['speedup_vs_ar']:.2f}x")]
    for name, a, b in lines:
        print(f"  {name:<28}{str(a):<{col}}{b}")
    print()
    for mode in ("ar", "sd"):
        print(f"  {mode} text: " + textwrap.shorten(texts[mode] or "<empty>", 200))
    if args.temperature == 0:
        print(f"\n  greedy outputs identical (lossless): {'yes' if same else 'NO'}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
