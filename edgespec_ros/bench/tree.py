"""Trees against the chain on a model pair, greedy: tokens committed per verification pass (tau)
and per draft forward, at the same drafting depth.

Exact without a verifier: under greedy verification the target accepts the longest path of the
tree that agrees with its own greedy output, which ``target_generate`` gives once per prompt. So
each round drafts a tree on the draft's sequence (``decoding.tree.draft_tree``: one forward per
level), takes the longest path that matches the target's tokens, commits it and the target's next
token, and compacts the draft's cache to that path, as a decision would. No time is measured here
(that is the emulated benchmark's job); what a tree buys per pass and per draft step is.

    python -m edgespec_ros.bench.tree --prompts 16 --memory 2 --shapes 4 2,2,2,2 2,2,2,1 3,3,3,3
"""
from __future__ import annotations

import argparse
import json
import statistics

from tqdm import tqdm

from ..cloud.target import target_generate
from ..decoding.inputs import build_inputs, jpeg_roundtrip
from ..decoding.memory import PromptFormat
from ..decoding.sampling import SamplingParams
from ..decoding.sequence import DraftSequence
from ..decoding.tree import ROOT, TreeShape, compact, draft_tree
from ..decoding.verify import VerifySettings
from ..robot.settings import DEFAULTS

GREEDY = SamplingParams()


def _accepted_path(tree, target: list[int], at: int) -> tuple[int, ...]:
    """The longest root path whose tokens are target[at], target[at + 1], ..."""
    node, path = ROOT, []
    while at + len(path) < len(target):
        want = target[at + len(path)]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            break
        node = nxt
        path.append(node)
    return tuple(path)


def tree_rounds(draft, target, prompts, shape: TreeShape, max_new_tokens: int = DEFAULTS.max_new_tokens) -> dict:
    """Greedy decisions on ``prompts`` ((instruction, image, history) or pairs) with ``shape``:
    rounds, committed tokens, draft forwards and drafted nodes in all."""
    rounds = committed = forwards = nodes = 0
    for prompt in prompts:
        instruction, image, *rest = prompt
        history = rest[0] if rest else ()
        image = jpeg_roundtrip(image)
        inputs = build_inputs(target.tokenizer, instruction, image, target.image_processor, history=history)
        want = target_generate(target, inputs, VerifySettings(GREEDY), max_new_tokens=max_new_tokens)
        d_inputs = build_inputs(draft.tokenizer, instruction, image, draft.image_processor, history=history)
        seq = DraftSequence(draft)
        seq.prefill(d_inputs)
        done = 0
        while done < len(want):
            drafted = draft_tree(seq, shape, GREEDY, seed=0, first_position=seq.fed)
            path = _accepted_path(drafted.tree, want, done)
            compact(seq, drafted, path)
            n = min(len(path) + 1, len(want) - done)
            rounds, committed, forwards, nodes = rounds + 1, committed + n, forwards + drafted.forwards, \
                nodes + len(drafted.tree)
            done += n
            if done < len(want):
                seq.pending = [want[done - 1]]  # the target's token after the path (fed with the next tree)
    return {"shape": shape.label(), "depth": shape.depth, "nodes_per_tree": shape.nodes, "rounds": rounds,
            "tokens": committed, "tau": committed / rounds if rounds else 0.0,
            "tokens_per_draft_forward": committed / forwards if forwards else 0.0, "draft_forwards": forwards,
            "drafted_nodes": nodes}


def main(argv=None) -> int:
    from ..decoding.engines import load_model
    from ..models import default_model_path
    from .runner import bench_prompts
    ap = argparse.ArgumentParser(prog="python -m edgespec_ros.bench.tree", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--memory", type=int, default=None, help="prompts as a policy with this memory is shown them "
                                                              "(default: the draft model's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    ap.add_argument("--shapes", nargs="+", default=["4", "2,2,2,2", "2,2,2,1", "3,3,3,3", "2,4,4,4"],
                    help="tree shapes: nodes per depth (a single number: the chain of that length)")
    ap.add_argument("--branch", type=int, default=2, help="children per node at most (default 2)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    draft, target = load_model(default_model_path("draft")), load_model(default_model_path("target"))
    memory = draft.memory if args.memory is None else args.memory
    prompts = bench_prompts(args.prompts, args.seed, PromptFormat(memory, bool(memory) and draft.belief))
    rows = []
    for text in tqdm(args.shapes, desc="shapes", unit="shape"):
        rows.append(tree_rounds(draft, target, prompts, TreeShape.parse(text, args.branch), args.max_new_tokens))
    chain = {r["depth"]: r["tau"] for r in rows if r["shape"] == "chain"}
    print(f"{'shape':<10} {'depth':>5} {'nodes':>5} {'tau':>6} {'vs chain':>8} {'tok/fwd':>7}")
    for r in rows:
        base = chain.get(r["depth"])
        r["tau_vs_chain"] = r["tau"] / base if base else None
        vs = f"{r['tau_vs_chain']:.2f}x" if base else "-"
        print(f"{r['shape']:<10} {r['depth']:>5} {r['nodes_per_tree']:>5} {r['tau']:>6.2f} {vs:>8} "
              f"{r['tokens_per_draft_forward']:>7.2f}")
    print(f"greedy, the committed pair, {args.prompts} prompts (memory {memory}), tau = tokens per verification pass")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python -m edgespec_ros.bench.tree " + " ".join(argv or []), "rows": rows,
                       "median_tau": statistics.median(r["tau"] for r in rows)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
