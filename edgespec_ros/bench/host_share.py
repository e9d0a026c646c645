"""How much of a batched verification pass is host work, and how many bytes leave tensor land.

``measure(lm, rows_list, block, passes)`` opens ``rows`` target sessions on ``lm`` (text prompts
of random ordinary ids, each of its own length, one token decoded so a round feeds its pending
token), runs ``cloud.batch.verify_batch`` passes of one round per session (``block`` tokens fed
per row: the pending token and ``block - 1`` drafts) and reports per rows count, as medians over
the passes:

- ``whole_s``: the pass (``verify_batch``), ``forward_s``: the model's forward inside it (both
  device-synchronised), ``host_share`` = 1 - forward / whole: the pass's inputs and bookkeeping
  around the forward, the logits, the rule (the KV slots' per-layer gather and in-place writes,
  ``cloud.batch.feed_batch``, run inside the forward and count as forward);
- ``host_bytes``: the bytes of every tensor converted to host Python or numpy during the pass
  (``.tolist()``, ``.item()``, ``.numpy()``, ``.cpu()``, ``float/int/bool/index`` of a tensor) outside
  the model's own forward, as counted by ``HostConversions``, whatever the code path; on an
  accelerator each is a device-to-host copy and a synchronisation. Beside it ``conversions``
  (calls), ``forward_conversions`` (transformers' own, inside the forward) and ``to_host_bytes``
  (what the verification path's ``decoding.verify.to_host`` counted itself).

On a CPU every tensor is a host tensor already, so the bytes are those that would cross on an
accelerator, not copies made here; timings are the CPU's. Mode ``sampled`` verifies
temperature-1 rejection-sampling rounds with a random q per draft, checked before the pass as the
session checks it when it decodes the block (q travels host -> device, which is not counted: it
enters tensor land).

``python -m edgespec_ros.bench.host_share`` measures the embedded target (``--shape mid``: a
random-weight Qwen2-VL with the real 151,936-token vocabulary, small enough for a CPU).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time

import torch

from ..cloud.batch import Round, verify_batch
from ..cloud.target import TargetSession
from ..decoding.engines import LoadedModel
from ..decoding.inputs import PromptInputs
from ..decoding.sampling import SamplingParams
from ..decoding.verify import VerifySettings, check_draft_probs_once

GREEDY = VerifySettings(SamplingParams(0.0), seed=0, verify_mode="greedy")
SAMPLED = VerifySettings(SamplingParams(1.0), seed=0, verify_mode="rejection")
MODES = {"greedy": GREEDY, "sampled": SAMPLED}
# A mid-size Qwen2-VL for a CPU: the 2B's vocabulary (what the logits' bytes scale with), a narrow
# two-layer trunk and a one-block vision tower (random weights).
MID = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
       "tie_word_embeddings": True,
       "vision_config": {"depth": 1, "embed_dim": 64, "mlp_ratio": 2, "num_heads": 2, "in_chans": 3,
                         "hidden_size": 256, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                         "temporal_patch_size": 2}}

_METHODS = ("tolist", "item", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__", "__array__")


class HostConversions:
    """While active, counts every conversion of a tensor to host Python or numpy (``_METHODS`` of
    ``torch.Tensor``) in this process: calls and bytes (numel x element size), split into those
    inside ``decoding.verify.to_host`` (the verification path's own door), those inside the
    forward of ``model`` (transformers' own bookkeeping), and the rest. One at a time."""

    _active: "HostConversions | None" = None

    def __init__(self, model: torch.nn.Module | None = None):
        self.model = model
        self.counts = {k: [0, 0] for k in ("to_host", "forward", "other")}  # bucket: [calls, bytes]
        self.where: dict[str, int] = {}  # "other" conversions by method
        self._depth = threading.local()
        self._saved, self._handles = {}, []

    def _bucket(self) -> str:
        from ..decoding import verify
        host = getattr(verify, "HOST", None)
        if host is not None and host.inside:
            return "to_host"
        return "forward" if getattr(self._depth, "n", 0) else "other"

    def __enter__(self):
        if HostConversions._active is not None:
            raise RuntimeError("HostConversions: one at a time")
        HostConversions._active = self
        for name in _METHODS:
            real = getattr(torch.Tensor, name)
            self._saved[name] = real

            def counted(t, *a, _real=real, _name=name, **k):
                bucket = self._bucket()
                c = self.counts[bucket]
                c[0] += 1
                c[1] += t.numel() * t.element_size()
                if bucket == "other":
                    self.where[_name] = self.where.get(_name, 0) + 1
                return _real(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        if self.model is not None:
            def pre(*_a, **_k):
                self._depth.n = getattr(self._depth, "n", 0) + 1

            def post(*_a, **_k):
                self._depth.n -= 1
            self._handles = [self.model.register_forward_pre_hook(pre), self.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(torch.Tensor, name, real)
        for h in self._handles:
            h.remove()
        HostConversions._active = None

    @property
    def host_bytes(self) -> int:
        """Bytes converted outside the model's forward (the verification path's)."""
        return self.counts["to_host"][1] + self.counts["other"][1]

    @property
    def conversions(self) -> int:
        return self.counts["to_host"][0] + self.counts["other"][0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ordinary_ids(lm: LoadedModel) -> list[int]:
    """Token ids that are no special token of the model's configuration."""
    cfg = lm.model.config
    special = set()
    for c in (cfg, getattr(cfg, "text_config", None)):
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "video_token_id",
                     "vision_start_token_id", "vision_end_token_id", "vision_token_id"):
            v = getattr(c, name, None) if c is not None else None
            special.update(v if isinstance(v, (list, tuple)) else [v] if isinstance(v, int) else [])
    return [i for i in range(lm.vocab_size) if i not in special]


def open_sessions(lm: LoadedModel, rows: int, settings: VerifySettings, seed: int = 0,
                  prompt_tokens: int = 48) -> list[TargetSession]:
    """``rows`` sessions prefilled on random text prompts of different lengths, one token decoded
    (pending): each round then feeds its pending token and its drafts."""
    rng = random.Random(seed)
    ids = _ordinary_ids(lm)
    sessions = []
    for i in range(rows):
        n = prompt_tokens + 3 * i
        prompt = torch.tensor([[rng.choice(ids) for _ in range(n)]], dtype=torch.long)
        s = TargetSession(lm)
        s.settings = settings
        s.seq.prefill(PromptInputs(input_ids=prompt, attention_mask=torch.ones_like(prompt)))
        s.ar_step()
        sessions.append(s)
    return sessions


def _rounds(lm: LoadedModel, sessions, block: int, mode: str, rng: random.Random, ids: list[int]) -> list[Round]:
    drafts = block - 1
    out = []
    for s in sessions:
        draft = [rng.choice(ids) for _ in range(drafts)]
        q = None
        if mode == "sampled":
            g = torch.Generator().manual_seed(rng.randrange(1 << 30))
            q = torch.softmax(torch.randn(drafts, lm.vocab_size, generator=g, dtype=torch.float64), -1)
            q[torch.arange(drafts), torch.tensor(draft)] += 1e-3  # the drafts had mass under q
            q = q / q.sum(-1, keepdim=True)
            # the session checks q when it decodes the block (on the host, where q arrives), before the pass
            check_draft_probs_once(torch.tensor(draft), q, lm.vocab_size)
        out.append(Round(s, draft, q))
    return out


def measure(lm: LoadedModel, rows_list=(1, 8, 16), block: int = 5, passes: int = 5, mode: str = "greedy",
            seed: int = 0) -> list[dict]:
    """Per rows count: the medians over ``passes`` verification passes (module docstring), and the
    per-pass figures (``passes_*``)."""
    settings = MODES[mode]
    rng = random.Random(seed)
    ids = _ordinary_ids(lm)
    dev = lm.device
    out = []
    for rows in rows_list:
        sessions = open_sessions(lm, rows, settings, seed)
        snaps = [s.seq.fork() for s in sessions]
        per = {k: [] for k in ("whole_s", "forward_s", "host_bytes", "conversions", "forward_conversions",
                               "to_host_bytes")}
        where: dict[str, int] = {}
        for k in range(passes + 1):  # the first pass warms up (not kept)
            for s, snap in zip(sessions, snaps):
                s.seq = snap.fork()
            rounds = _rounds(lm, sessions, block, mode, rng, ids)
            forward = []
            t_fwd = [0.0]

            def pre(*_a, **_k):
                _sync(dev)
                t_fwd[0] = time.perf_counter()

            def post(*_a, **_k):
                _sync(dev)
                forward.append(time.perf_counter() - t_fwd[0])
            handles = [lm.model.register_forward_pre_hook(pre), lm.model.register_forward_hook(post)]
            try:
                with HostConversions(lm.model) as conv:
                    _sync(dev)
                    t0 = time.perf_counter()
                    result = verify_batch(rounds)
                    _sync(dev)
                    whole = time.perf_counter() - t0
            finally:
                for h in handles:
                    h.remove()
            bad = [e for e in result.errors if e is not None]
            if bad:
                raise bad[0]
            if k == 0:
                continue
            per["whole_s"].append(whole)
            per["forward_s"].append(sum(forward))
            per["host_bytes"].append(conv.host_bytes)
            per["conversions"].append(conv.conversions)
            per["forward_conversions"].append(conv.counts["forward"][0])
            per["to_host_bytes"].append(conv.counts["to_host"][1])
            for name, n in conv.where.items():
                where[name] = where.get(name, 0) + n
        med = {k: float(statistics.median(v)) for k, v in per.items()}
        med["host_share"] = 1.0 - med["forward_s"] / med["whole_s"] if med["whole_s"] > 0 else float("nan")
        out.append({"rows": rows, "block": block, "mode": mode, "vocab": lm.vocab_size, **med,
                    "other_by_method": {k: v / passes for k, v in sorted(where.items())},
                    **{f"passes_{k}": v for k, v in per.items()}})
    return out


def load(shape: str, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """The embedded target (``embedded``), or a random-weight Qwen2-VL: ``mid`` (``MID``) or a
    ``bench/shapes`` name (qwen2-vl-2b, ...), on ``device`` in ``dtype``."""
    from ..decoding.engines import load_model, resolve_device, resolve_dtype
    if shape == "embedded":
        from ..models import resolve_models
        return load_model(resolve_models(None, None).target_path, dtype=dtype, device=device)
    from .gpu_measure import build_lm, load_shape
    if shape == "mid":
        spec = {**load_shape("qwen2-vl-2b"), **MID, "_name": "qwen2-vl-mid-cpu"}
    else:
        spec = load_shape(shape)
    dev = resolve_device(device)
    return build_lm(spec, dev, resolve_dtype(dtype, dev))


def format_table(results: list[dict]) -> str:
    lines = [f"{'rows':>4} {'mode':>7} {'host bytes/pass':>16} {'conv':>5} {'to_host B':>10} "
             f"{'whole ms':>9} {'fwd ms':>8} {'host share':>10}"]
    for r in results:
        lines.append(f"{r['rows']:>4} {r['mode']:>7} {r['host_bytes']:>16,.0f} {r['conversions']:>5.0f} "
                     f"{r['to_host_bytes']:>10,.0f} {1e3 * r['whole_s']:>9.2f} {1e3 * r['forward_s']:>8.2f} "
                     f"{r['host_share']:>10.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec_ros.bench.host_share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="embedded", help="embedded (default), mid, or a bench/shapes name")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--modes", default="greedy,sampled")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load(args.shape, args.device, args.dtype)
    rows = tuple(int(r) for r in args.rows.split(","))
    results = []
    for mode in args.modes.split(","):
        results += measure(lm, rows, args.block, args.passes, mode)
    print(f"{args.shape} on {lm.device} ({args.dtype}): vocab {lm.vocab_size}, block {args.block}, "
          f"median of {args.passes} passes")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
