"""What edgespec-profile measures, as plain functions: real-size Qwen2-VL shapes built with random
weights (``bench/shapes``), synthetic robot prompts, device-synchronised timing, the verification
grid, early exits, drafting, and the batch-invariance check. ``bench.gpu_profile`` runs them and
writes the profile."""
from __future__ import annotations

import json
import os
import random
import statistics
import time

import torch

from ..cloud.batch import ArStep, Round, feed_batch, verify_batch
from ..cloud.target import TargetSession
from ..decoding.verify import VerifySettings
from ..decoding.engines import LoadedModel
from ..decoding.inputs import PromptInputs
from ..decoding.sampling import SamplingParams
from ..decoding.sequence import Sequence

SHAPES_DIR = os.path.join(os.path.dirname(__file__), "shapes")
GREEDY = VerifySettings(SamplingParams(0.0), seed=0, verify_mode="greedy")

ROWS_DEFAULT = (1, 2, 4, 8, 12, 16)
BLOCKS_DEFAULT = (1, 2, 3, 4, 5, 6, 8, 12, 16)
INVARIANCE_BATCHES = (1, 2, 4, 8, 16)  # 1: every round verified alone (block invariance only)


def load_shape(name: str) -> dict:
    """A shape (config values) by name (``bench/shapes/<name>.json``) or path."""
    path = name if name.endswith(".json") else os.path.join(SHAPES_DIR, f"{name}.json")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(SHAPES_DIR) if f.endswith(".json"))
        raise SystemExit(f"edgespec-profile: no model shape {name!r} (known: {', '.join(known)}, or a .json path)")
    with open(path) as f:
        shape = json.load(f)
    shape.setdefault("_name", os.path.basename(path)[:-5])
    return shape


def build_config(shape: dict):
    from transformers import Qwen2VLConfig
    return Qwen2VLConfig(**{k: v for k, v in shape.items() if not k.startswith("_")})


def special(config, name: str) -> int | None:
    """A special token id of the configuration (transformers 5 keeps some on the text config)."""
    v = getattr(config, name, None)
    if v is None:
        v = getattr(getattr(config, "text_config", None), name, None)
    return v


class ShapeTokens:
    """What the engines ask of a tokenizer, for a model with no tokenizer (random weights): the
    special ids of the shape's configuration."""

    unk_token_id = None

    def __init__(self, config):
        self.eos_token_id = special(config, "eos_token_id")
        self._ids = {t: special(config, n) for t, n in (("<|image_pad|>", "image_token_id"), ("<|im_end|>", "eos_token_id"),
                                                       ("<|vision_start|>", "vision_start_token_id"),
                                                       ("<|vision_end|>", "vision_end_token_id"))}

    def convert_tokens_to_ids(self, token: str):
        return self._ids.get(token)


def build_lm(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """A Qwen2-VL of the shape with random weights, on ``device`` in ``dtype`` (built as
    ``from_pretrained(..., dtype=)`` builds it: rotary frequency buffers stay float32)."""
    from transformers import Qwen2VLForConditionalGeneration
    from ..decoding.engines import decoding_attention
    config = build_config(shape)
    decoding_attention(device)  # as load_model does
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=dtype)
    model = model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, ShapeTokens(config), None, f"<random {shape['_name']}>", True)


def param_count(shape: dict) -> int:
    """Parameters of the shape (built on the meta device: no memory)."""
    from transformers import Qwen2VLForConditionalGeneration
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(build_config(shape))
    return sum(p.numel() for p in model.parameters())


def text_id_range(config) -> int:
    """Ordinary text ids are drawn below the first special id."""
    ids = [special(config, n) for n in ("eos_token_id", "image_token_id", "vision_start_token_id",
                                        "vision_end_token_id", "bos_token_id")]
    return min(int(i) for i in ids if i is not None)


def synthetic_prompt(config, seed: int, image: int = 448, text: int = 48, history: int = 96) -> PromptInputs:
    """A prompt shaped like the robot's: a system/instruction text, one image of image x image
    pixels (its patches random), and ``history`` tokens of earlier decisions, then the assistant
    turn. Token ids are random ordinary ids (random weights make their identity irrelevant)."""
    g = torch.Generator().manual_seed(seed)
    vc = config.vision_config
    patch, merge, tp = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
    side = image // patch
    side -= side % merge
    n_image = side * side // merge ** 2
    high = text_id_range(config)

    def words(n):
        return torch.randint(0, high, (n,), generator=g).tolist()
    image_id = special(config, "image_token_id")
    ids = (words(text // 2) + [special(config, "vision_start_token_id")] + [image_id] * n_image
           + [special(config, "vision_end_token_id")] + words(text - text // 2 + history)
           + [special(config, "eos_token_id")] + words(3))
    input_ids = torch.tensor([ids], dtype=torch.long)
    pixels = torch.randn(side * side, 3 * tp * patch * patch, generator=g)
    return PromptInputs(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                        image_grid_thw=torch.tensor([[1, side, side]]),
                        mm_token_type_ids=(input_ids == image_id).long())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Wall seconds of fn() per repetition (device synchronised around each)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


class ForwardClock:
    """Times every call of the model's forward (synchronised): the pass alone, without the host
    work around it."""

    def __init__(self, lm: LoadedModel):
        self.lm, self.times, self._t0, self._handles = lm, [], 0.0, []

    def __enter__(self):
        dev = self.lm.device

        def pre(*_a, **_k):
            _sync(dev)
            self._t0 = time.perf_counter()

        def post(*_a, **_k):
            _sync(dev)
            self.times.append(time.perf_counter() - self._t0)
        self._handles = [self.lm.model.register_forward_pre_hook(pre), self.lm.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def open_sessions(lm: LoadedModel, prompts: list[PromptInputs]) -> list[TargetSession]:
    """Sessions prefilled on their prompts, each with one token decoded (pending): a round then
    feeds the pending token plus its drafts."""
    sessions = []
    for p in prompts:
        s = TargetSession(lm)
        s.settings = GREEDY
        s.seq.prefill(p)
        s.ar_step()
        sessions.append(s)
    return sessions


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def measure_prefill(lm: LoadedModel, prompt: PromptInputs, reps: int) -> dict:
    seq = Sequence(lm)
    times = timed(lambda: seq.prefill(prompt), lm.device, reps)
    return {"tokens": prompt.num_tokens, "image_tokens": int(prompt.mm_token_type_ids.sum()),
            "s": _med(times), "all_s": times}


def measure_grid(lm: LoadedModel, sessions: list[TargetSession], rows_list, blocks, reps: int, seed: int,
                 bar=None, passes: int = 1) -> list[dict]:
    """One entry per (rows, block): the verification pass (verify_batch: what the verifier runs)
    and the model's forward inside it. block 1 is the AR step (ArStep); block b > 1 a round of
    b - 1 drafts plus the pending token. With ``passes`` > 1 the whole grid is swept that many
    times, ``reps`` per point each time (a machine whose speed drifts then slows every point
    alike); the median is over all."""
    rng = random.Random(seed)
    high = text_id_range(lm.model.config)
    snaps = [s.seq.fork() for s in sessions]
    points = [(rows, block) for rows in rows_list for block in blocks]
    times = {p: [] for p in points}
    forward = {p: [] for p in points}
    kv = {}
    for _ in range(passes):
        for rows, block in points:
            for s, snap in zip(sessions, snaps):
                s.seq = snap.fork()
            group = sessions[:rows]

            def one():
                if block == 1:
                    items = [ArStep(s) for s in group]
                else:
                    items = [Round(s, [rng.randrange(high) for _ in range(block - 1)], None) for s in group]
                for r in verify_batch(items):
                    if isinstance(r, Exception):
                        raise r
            one()  # warm-up (and the first shape's kernels)
            with ForwardClock(lm) as clock:
                times[(rows, block)] += timed(one, lm.device, reps, warmup=0)
            forward[(rows, block)] += clock.times
            fed = [s.seq.fed for s in group]
            kv[(rows, block)] = (min(fed), max(fed))
            if bar is not None:
                bar.update(1)
    for s, snap in zip(sessions, snaps):
        s.seq = snap
    return [{"rows": r, "block": b, "s": _med(times[(r, b)]), "forward_s": _med(forward[(r, b)]),
             "kv_min": kv[(r, b)][0], "kv_max": kv[(r, b)][1], "all_s": times[(r, b)],
             "pass_s": pass_medians(times[(r, b)], reps), "pass_forward_s": pass_medians(forward[(r, b)], reps)}
            for r, b in points]


def pass_medians(samples: list[float], reps: int) -> list[float]:
    """The median of each pass's ``reps`` samples (a grid point's samples are kept pass by pass)."""
    return [_med(samples[i:i + reps]) for i in range(0, len(samples), reps)]


def device_state(device: torch.device) -> dict:
    """What the speed of a launch-bound eager forward depends on, read now: the host's speed (a
    fixed Python loop), the accelerator's (a fixed matrix product) and its clocks."""
    t0 = time.perf_counter()
    x = 0
    for i in range(200_000):
        x += i
    state = {"host_loop_ms": (time.perf_counter() - t0) * 1e3, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        _sync(device)
        state["matmul_tflops"] = 20 * 2 * 4096 ** 3 / (time.perf_counter() - t0) / 1e12
        launches = torch.zeros(1, device=device)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(1000):
            launches.add_(1)
        _sync(device)
        state["launch_us"] = (time.perf_counter() - t0) * 1e3
        import subprocess
        try:
            state["clocks"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,utilization.gpu,power.draw",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return state


def warm_device(device: torch.device, seconds: float) -> None:
    """Keep the accelerator busy for ``seconds`` (its clocks up) before timing."""
    if device.type != "cuda" or seconds <= 0:
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        _sync(device)


def measure_exits(lm: LoadedModel, sessions: list[TargetSession], layers: list[int], rows_list, block: int,
                  reps: int, seed: int) -> dict:
    """Cost of early exits: the same batched rounds with every session streaming its exits, minus
    without; per exit per session (``exit_s`` of the compute profile)."""
    from ..decoding.exits import EarlyExits
    param = next(lm.model.parameters())
    lm.exits = EarlyExits.for_model(lm.model, layers=layers).to(device=param.device, dtype=param.dtype).eval()
    rng = random.Random(seed)
    high = text_id_range(lm.model.config)
    snaps = [s.seq.fork() for s in sessions]
    rows_out = []
    try:
        for rows in rows_list:
            per = {}
            for streaming in (False, True):
                for s, snap in zip(sessions, snaps):
                    s.seq = snap.fork()
                group = sessions[:rows]
                got = []

                def one():
                    items = [Round(s, [rng.randrange(high) for _ in range(block - 1)], None,
                                   on_exit=got.append if streaming else None) for s in group]
                    for r in verify_batch(items):
                        if isinstance(r, Exception):
                            raise r
                one()
                per[streaming] = _med(timed(one, lm.device, reps, warmup=0))
            extra = per[True] - per[False]
            rows_out.append({"rows": rows, "block": block, "exits": len(layers), "plain_s": per[False],
                             "with_exits_s": per[True], "per_exit_per_session_s": extra / (len(layers) * rows)})
    finally:
        lm.exits = None
        for s, snap in zip(sessions, snaps):
            s.seq = snap
    return {"layers": list(layers), "rank": lm.model.config.text_config.hidden_size // 4, "rows": rows_out,
            # a tiny model's exits cost less than the timing noise: a negative median is noise, not a gain
            "exit_s": max(0.0, _med([r["per_exit_per_session_s"] for r in rows_out]))}


def measure_drafting(lm: LoadedModel, prompt: PromptInputs, tokens: int, seed: int) -> dict:
    """Per-token drafting (one token fed per forward, KV cached) after a prefill."""
    rng = random.Random(seed)
    high = text_id_range(lm.model.config)
    seq = Sequence(lm)
    seq.prefill(prompt)
    seq.feed([rng.randrange(high)])
    times = timed(lambda: seq.feed([rng.randrange(high)]), lm.device, tokens, warmup=2)
    return {"tokens": tokens, "s": _med(times), "p90_s": sorted(times)[int(0.9 * (len(times) - 1))]}


# --- batch invariance -------------------------------------------------------------------------

def lone_reference(lm: LoadedModel, prompt: PromptInputs, max_new: int) -> tuple[list[int], list[float]]:
    """The target decoding the prompt alone, greedy, one token per forward (the AR baseline):
    its tokens and, at each, the margin between its two largest logits."""
    s = TargetSession(lm)
    s.settings = GREEDY
    s.seq.prefill(prompt)
    eos = lm.eos_token_ids
    tokens, margins = [], []
    for _ in range(max_new):
        token, _ = s.ar_step()
        top2 = s.seq.last_logits.topk(2).values
        tokens.append(token)
        margins.append(float(top2[0] - top2[1]))
        if token in eos:
            break
    return tokens, margins


def _trim(tokens: list[int], max_new: int, eos: set) -> list[int]:
    out = []
    for t in tokens[:max_new]:
        out.append(t)
        if t in eos:
            break
    return out


def sd_batched(lm: LoadedModel, prompts: list[PromptInputs], refs: list[list[int]], max_news: list[int],
               batch: int, gamma: int, seed: int, corrupt: float = 0.3) -> dict:
    """Greedy SD over all prompts with at most ``batch`` sessions verified together: sessions
    join as others leave (session i may join from round i // 2), each round's draft is the lone
    reference continuation with a share ``corrupt`` of its tokens replaced (so rounds accept,
    reject and end at various places). Returns each session's committed tokens and batch stats."""
    rng = random.Random(seed)
    high = text_id_range(lm.model.config)
    eos = lm.eos_token_ids
    n = len(prompts)
    sessions: list[TargetSession | None] = [None] * n
    done = [False] * n
    rounds = sizes = 0
    while not all(done):
        active = [i for i in range(n) if sessions[i] is not None and not done[i]]
        for i in range(n):
            if sessions[i] is None and len(active) < batch and rounds >= i // 2:
                s = TargetSession(lm)
                s.settings = GREEDY
                s.seq.prefill(prompts[i])
                sessions[i] = s
                active.append(i)
        items = []
        for i in active:
            pos, ref = sessions[i].position, refs[i]
            draft = [ref[pos + k] if pos + k < len(ref) and rng.random() >= corrupt else rng.randrange(high)
                     for k in range(gamma)]
            items.append(Round(sessions[i], draft, None))
        for i, r in zip(active, verify_batch(items)):
            if isinstance(r, Exception):
                raise r
            g = sessions[i].seq.generated
            if len(g) >= max_news[i] or any(t in eos for t in g):
                done[i] = True
        rounds += 1
        sizes += len(items)
    outs = [_trim(s.seq.generated, m, eos) for s, m in zip(sessions, max_news)]
    return {"tokens": outs, "rounds": rounds, "mean_batch": sizes / max(rounds, 1)}


def compare(refs: list[list[int]], outs: list[list[int]]) -> dict:
    """Divergent decisions and, for each, the first position where the tokens differ."""
    first = []
    for ref, out in zip(refs, outs):
        if ref != out:
            first.append(next((k for k, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out))))
    return {"decisions": len(refs), "divergent": len(first), "first_divergent_positions": first,
            "tokens": sum(len(r) for r in refs)}


def logit_deltas(lm: LoadedModel, sessions: list[TargetSession], block: int, seed: int) -> dict:
    """The same block fed to each session alone and to all of them in one batched pass: the
    largest logit difference and how many rows' argmax differs."""
    rng = random.Random(seed)
    high = text_id_range(lm.model.config)
    drafts = [[rng.randrange(high) for _ in range(block - 1)] for _ in sessions]
    alone, together = [], []
    for s, d in zip(sessions, drafts):
        seq = s.seq.fork()
        alone.append(seq.feed(seq.take_pending() + d))
    forks = [s.seq.fork() for s in sessions]
    together = feed_batch(forks, [f.take_pending() + d for f, d in zip(forks, drafts)])
    deltas = torch.stack([(a - b).abs().max() for a, b in zip(alone, together)])
    flips = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in zip(alone, together))
    spread = float(torch.cat([a.std(-1) for a in alone]).mean())
    return {"rows": len(sessions), "block": block, "max_abs_delta": float(deltas.max()),
            "mean_max_abs_delta": float(deltas.mean()), "logit_std": spread,
            "argmax_flips": flips, "positions": len(sessions) * block}


def batch_invariance(lm: LoadedModel, prompts: list[PromptInputs], batches, gamma: int, max_new: int,
                     seed: int, bar=None) -> dict:
    eos = lm.eos_token_ids
    refs, margins = [], []
    for p in prompts:
        tokens, m = lone_reference(lm, p, max_new)
        refs.append(tokens)
        margins += m
        if bar is not None:
            bar.update(1)
    max_news = [max_new - (i % 4) * 2 for i in range(len(prompts))]  # decisions of different lengths
    refs = [_trim(r, m, eos) for r, m in zip(refs, max_news)]
    runs = []
    for batch in batches:
        res = sd_batched(lm, prompts, refs, max_news, batch, gamma, seed + batch)
        runs.append({"batch": batch, "rounds": res["rounds"], "mean_batch": res["mean_batch"],
                     **compare(refs, res["tokens"])})
        if bar is not None:
            bar.update(1)
    ms = sorted(margins)
    return {"gamma": gamma, "max_new_tokens": max_new, "runs": runs,
            "margin": {"median": ms[len(ms) // 2], "p01": ms[int(0.01 * (len(ms) - 1))], "min": ms[0],
                       "count": len(ms)}}
