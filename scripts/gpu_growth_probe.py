"""Diagnostic for edgespec-profile (issue 36): is a forward slower when the KV cache grows (new tensor
sizes every step, as in a live verifier) than when it is restored to the same length (as the grid
does between repetitions)? Prints ms per single-token forward, growing and fixed, for each shape."""
import json
import os
import statistics
import sys
import time

import torch

from edgespec_ros.bench import gpu_measure as gp
from edgespec_ros.decoding.sequence import Sequence


def probe(name: str, device: torch.device, steps: int = 40) -> dict:
    shape = gp.load_shape(name)
    lm = gp.build_lm(shape, device, torch.bfloat16, 0)
    cfg = lm.model.config
    prompt = gp.synthetic_prompt(cfg, 1)
    seq = Sequence(lm)
    seq.prefill(prompt)
    seq.feed([5])
    gp.warm_device(device, 3.0)
    out = {}

    def tok():
        seq.feed([7])
    out["growing_ms"] = [t * 1e3 for t in gp.timed(tok, device, steps, warmup=2)]
    snap = seq.fork()

    def fixed():
        nonlocal seq
        seq = snap.fork()
        gp._sync(device)
        t0 = time.perf_counter()
        seq.feed([7])
        gp._sync(device)
        return time.perf_counter() - t0
    for _ in range(3):
        fixed()
    out["fixed_ms"] = [fixed() * 1e3 for _ in range(steps)]
    out["growing_again_ms"] = [t * 1e3 for t in gp.timed(tok, device, steps, warmup=0)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            tok()
        gp._sync(device)
    out["top_cpu"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
    del lm, seq, snap
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main():
    device = torch.device(os.environ.get("PROBE_DEVICE", "cuda"))
    res = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    for name in sys.argv[2:] or ["qwen2-vl-2b", "qwen2-vl-7b"]:
        r = probe(name, device)
        res[name] = r
        print(f"{name} [{res['alloc_conf'] or 'default allocator'}]: growing {statistics.median(r['growing_ms']):.1f} ms, "
              f"fixed {statistics.median(r['fixed_ms']):.1f} ms, growing again {statistics.median(r['growing_again_ms']):.1f} ms",
              flush=True)
        print(r["top_cpu"][:1200], flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
