"""edgespec-bench: decoding modes side by side over an emulated edge-cloud link."""
from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from ..codecs import get_codec
from ..spec.compute import COMPUTE_PROFILES, get_compute
from ..spec.decode import DECODING_MODES
from ..spec.sampling import SamplingParams
from ..wire.link import PROFILES
from .runner import add_speedups, bench_prompts, emulated_setup, env_threads, format_table, resolve_models, run_modes


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="edgespec-bench", description=__doc__)
    ap.add_argument("--modes", default="ar,sd", help=f"comma-separated modes from {','.join(DECODING_MODES)} (default ar,sd)")
    ap.add_argument("--link", default="wifi-poor", choices=list(PROFILES), help="emulated link profile")
    ap.add_argument("--compute", default="native", choices=list(COMPUTE_PROFILES),
                    help="native, or pad compute to the paper's Go2 hardware (go2-paper, emulated)")
    ap.add_argument("--decisions", type=int, default=8, help="decisions (prompts) per mode")
    ap.add_argument("--gamma", type=int, default=4, help="draft length")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--codec", default="dense32",
                    help="uplink codec spec for q: dense32, dense16, topk:k=8, ksqs:k=8,l=32, "
                         "csqs:l=100,eta=0.001,alpha=0.0005, ids (default dense32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft", default=None, help="draft model dir (default: embedded draft)")
    ap.add_argument("--target", default=None, help="target model dir (default: embedded target)")
    ap.add_argument("--json", default=None, help="write the rows as a JSON list to this file")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in DECODING_MODES]
    if bad:
        print(f"edgespec-bench: unknown mode(s) {bad}; choose from {DECODING_MODES}", file=sys.stderr)
        return 2
    try:
        args.codec = get_codec(args.codec).spec
    except ValueError as exc:
        print(f"edgespec-bench: --codec: {exc}", file=sys.stderr)
        return 2
    env_threads()
    compute = get_compute(args.compute)
    pair = resolve_models(args.draft, args.target)
    prompts = bench_prompts(args.decisions, args.seed)
    params = SamplingParams(args.temperature, args.top_k, args.top_p)
    print(f"models: {pair.label}\nlink: {PROFILES[args.link].describe()}\ncompute: {compute.name}"
          f"{' (EMULATED: padded to the paper Go2 latencies)' if compute.emulated else ''}")
    with emulated_setup(pair, args.link, args.compute) as (draft_lm, url):
        bar = tqdm(total=len(modes) * len(prompts), desc="decisions", unit="dec")
        summaries = run_modes(draft_lm, url, modes, prompts, link=args.link, compute=compute, gamma=args.gamma,
                              max_new_tokens=args.max_new_tokens, params=params, seed=args.seed, codec=args.codec,
                              on_decision=lambda *a: bar.update(1))
        bar.close()
    rows = add_speedups([summaries[m].row() | {"codec": args.codec, "temperature": args.temperature}
                         for m in modes])
    print(format_table(rows, compute.emulated))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
