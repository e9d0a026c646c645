#!/usr/bin/env python3
"""Seconds per training step of the target's shape on this machine (batch 32 of a data stage's
examples, forward + backward + AdamW, torch's default threads), for comparing OpenMP wait policies
and thread counts. Set the environment before it starts, e.g.

    GOMP_SPINCOUNT=1000 python scripts/train_step_time.py --work build/train-memgap
    OMP_WAIT_POLICY=PASSIVE python scripts/train_step_time.py --work build/train-memgap

and run it beside a busy core (``python3 -c "while True: pass" &``) to see the contended case.
Prints one JSON line. Needs a data stage and a tokenizer in --work (``edgespec-train data
tokenizer``)."""
import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="build/train", help="a work dir with dataset.npz and tokenizer/")
    ap.add_argument("--steps", type=int, default=15, help="timed steps (after 3 warm-up steps)")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from edgespec_ros.models import tiny
    from edgespec_ros.train.dataset import load_dataset
    from edgespec_ros.train.recipe import MODEL_SPECS
    from edgespec_ros.train.data import collate, encode_example
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(os.path.join(args.work, "tokenizer"))
    ip = tiny.image_processor()
    examples = load_dataset(args.work)[:32]
    batch = collate([encode_example(tok, ip, e.image, e.instruction, e.text, None, e.history) for e in examples],
                    tok, ip)
    model = tiny.tiny_qwen2vl(tok, seed=0, **MODEL_SPECS["target"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    print(json.dumps({"s_per_step": round((time.perf_counter() - started) / args.steps, 3),
                      "threads": torch.get_num_threads(),
                      "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
                      "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}))


if __name__ == "__main__":
    main()
