"""Probe (issue 37, not in the product): would a robot-side guard against left/right limit cycles pay?

The target decides greedily as the card's closed loop does (``sim.evaluate.run_episode``), except
that after a turn reversal (a turn the opposite way of the turn just before it) the next
``--hold`` decisions may not turn back: the token of the reversing direction is masked wherever
it would follow "turn" (constrained greedy decoding, as a serving stack's bad-words list does).
The model is unchanged; only what it may say is. Prints success, collisions, failure kinds and how
often the mask changed the argmax; writes the per-episode record to ``--json``.

    python scripts/reversal_guard_probe.py --hold 1 --episodes 0:60 --json /tmp/g.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OPPOSITE = {"left": "right", "right": "left"}


class ReversalGuard:
    """A VLMPolicy-like policy (``decide``) over a loaded target with the reversal mask."""

    def __init__(self, lm, hold: int, max_new_tokens: int = 96):
        self.lm, self.memory, self.hold, self.max_new_tokens = lm, lm.memory, hold, max_new_tokens
        tok = lm.tokenizer
        self.turn_seqs = [tok(w, add_special_tokens=False)["input_ids"] for w in ("turn", " turn")]
        self.direction_id = {d: tok(" " + d, add_special_tokens=False)["input_ids"][0] for d in OPPOSITE}
        self.actions: list[str | None] = []
        self.banned_for = 0
        self.banned: str | None = None
        self.interventions = 0

    def _update_ban(self) -> None:
        turns = [a.split()[1] if a and a.startswith("turn ") else None for a in self.actions[-2:]]
        if len(turns) == 2 and all(turns) and turns[0] != turns[1]:  # a reversal just happened
            self.banned, self.banned_for = OPPOSITE[turns[1]], self.hold
        elif self.banned_for:
            self.banned_for -= 1
        if not self.banned_for:
            self.banned = None

    def decide(self, image, instruction, temperature=0.0, seed=0, history=()):
        from edgespec_ros.cloud.target import TargetSession
        from edgespec_ros.control.actions import ActionParseError, parse_action
        from edgespec_ros.decoding.inputs import build_inputs, jpeg_roundtrip
        from edgespec_ros.decoding.verify import VerifySettings
        from edgespec_ros.evaluation.policy import PolicyOutput
        if not history:  # an episode's first decision
            self.actions, self.banned, self.banned_for = [], None, 0
        else:
            self._update_ban()
        inputs = build_inputs(self.lm.tokenizer, instruction, jpeg_roundtrip(image), self.lm.image_processor,
                              history=history)
        session = TargetSession(self.lm)
        session.settings = VerifySettings()
        session.seq.prefill(inputs)
        out, changed = [], False
        for _ in range(self.max_new_tokens):
            logits = session.seq.next_logits().clone()
            if self.banned and any(out[-len(s):] == s for s in self.turn_seqs if len(out) >= len(s)):
                banned_id = self.direction_id[self.banned]
                changed |= int(logits.argmax()) == banned_id
                logits[..., banned_id] = float("-inf")
            token = int(logits.argmax())
            session.seq.append_generated(token)
            out.append(token)
            if token in self.lm.eos_token_ids:
                break
        self.interventions += changed
        text = self.lm.tokenizer.decode([t for t in out if t not in self.lm.eos_token_ids], skip_special_tokens=True)
        try:
            action = parse_action(text)
        except ActionParseError as exc:
            self.actions.append(None)
            return PolicyOutput(text, None, str(exc), len(out))
        self.actions.append(action.text)
        return PolicyOutput(text, action, None, len(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="edgespec_ros/models/target")
    ap.add_argument("--hold", type=int, default=1, help="decisions after a reversal that may not reverse (0: no guard)")
    ap.add_argument("--episodes", default="0:120", help="FIRST:END of the card's held-out episodes")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from edgespec_ros.decoding.engines import load_model
    from edgespec_ros.sim.dataset import iter_scenarios
    from edgespec_ros.sim.evaluate import evaluate_closed_loop, failure_counts
    first, end = (int(x) for x in args.episodes.split(":"))
    policy = ReversalGuard(load_model(args.target), args.hold)
    scenarios = list(iter_scenarios("heldout", end, max_steps=40))[first:end]
    t0 = time.monotonic()
    report = evaluate_closed_loop(policy, scenarios)
    report.update(failures=failure_counts(report["per_scenario"]), interventions=policy.interventions,
                  hold=args.hold, episodes=[first, end], seconds=round(time.monotonic() - t0))
    print(f"hold {args.hold}, episodes {first}-{end}: success {report['success_rate']:.1%}, collisions "
          f"{report['collisions']}, unparseable {report['unparseable_decisions']}, failures {report['failures']}, "
          f"decisions the mask changed {policy.interventions}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
