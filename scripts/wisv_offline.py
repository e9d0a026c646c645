#!/usr/bin/env python3
"""WISV (lossy) measured offline, until `edgespec-bench --sweep wisv` runs it over real links:
greedy SD rounds of the embedded draft against the target replayed in process on held-out
frames, the committed decision head deciding at each mismatch under each link's CSI. Rounds are
counted, the link's time is not waited. Prints accepted drafts per round, rounds per decision and
the action agreement with the target alone (threshold 0 = greedy SD: agreement 1 by construction).

    PYTHONPATH=. .venv/bin/python scripts/wisv_offline.py --frames 100
"""
import argparse

from tqdm import tqdm

from edgespec_ros.decoding.cloud import target_generate
from edgespec_ros.decoding.edge import DecodeConfig
from edgespec_ros.decoding.engines import load_model
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.decoding.wisv import Csi, DecisionHead, action_of_tokens, prompt_pair, replay_rounds, wisv_choice
from edgespec_ros.models import default_model_path
from edgespec_ros.sim.dataset import heldout_prompts
from edgespec_ros.wire.link import get_profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=100, help="held-out frames (from scenario seed 1000)")
    ap.add_argument("--links", nargs="+", default=["lan", "cellular", "go2-paper"])
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.1, 0.2, 0.3, 0.5])
    args = ap.parse_args()
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    head, _ = DecisionHead.load(default_model_path("target") + "/wisv")

    def action(tokens):
        return action_of_tokens(target, tokens)

    pairs = [prompt_pair(draft, target, i, im) for i, im in heldout_prompts(args.frames, seed=1000)]
    greedy = DecodeConfig(mode="ar", max_new_tokens=96, params=SamplingParams(temperature=0.0))
    references = [action(target_generate(target, t, greedy)) for _, t in tqdm(pairs, desc="target alone")]
    runs = [("any", 0.0)] + [(link, tau) for link in args.links for tau in args.thresholds]
    print("link       threshold  accepted/round  rounds/decision  agreement   (LOSSY for threshold > 0)")
    for link, tau in runs:
        csi = Csi.from_profile(get_profile("lan" if link == "any" else link))
        accepted, rounds, agree = [], 0, 0
        for (d, t), ref in zip(pairs, references):
            tokens, per_round = replay_rounds(draft, target, d, t, wisv_choice(head, csi, tau))
            accepted += per_round
            rounds += len(per_round)
            agree += action(tokens) == ref
        print(f"{link:10s} {tau:9.2f}  {sum(accepted) / len(accepted):14.2f}  {rounds / len(pairs):15.2f}  "
              f"{agree / len(pairs):9.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
