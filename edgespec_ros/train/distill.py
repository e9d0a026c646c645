"""Distillation: train the draft *for* its target.

Speculative decoding is as fast as the draft agrees with the target, and a draft trained on the
expert's text alone agrees with whatever target it is paired with only by chance. Following
DistillSpec (Zhou et al., ICLR 2024) and GKD (Agarwal et al., 2024), the draft here learns the
target's own next-token distributions on continuations that the draft itself proposes (on-policy:
what speculative decoding will ask it to predict), mixed with the target's greedy outputs (what the
verifier commits at temperature 0). The loss is one of three divergences between the target's
distribution ``p`` and the draft's ``q`` at every continuation position:

- ``fkl``: forward KL(p || q), mass-covering (the usual knowledge distillation),
- ``rkl``: reverse KL(q || p), mode-seeking,
- ``tvd``: total variation 0.5 * sum |p - q|: at temperature 1 a token's acceptance probability is
  exactly 1 - TV(p, q) (Leviathan et al., 2023), so this optimises acceptance directly.

Everything works for any Qwen2-VL draft/target pair that shares a vocabulary (the embedded pair,
or Qwen2-VL-2B/7B given as local directories on a GPU with ``device``). The target's
distributions come from a forward pass in process, or from the fleet's verified traffic
(``cloud.traces``): there the verifier already computed them, and only their top-k was kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ..decoding.inputs import IMAGE_PAD, VISION_END, VISION_START, build_inputs

DIVERGENCES = ("fkl", "rkl", "tvd")


@dataclass
class DistillConfig:
    divergence: str = "tvd"
    steps: int = 400
    time_budget_s: float = 0.0  # 0: none; else stop there, the learning-rate schedule shrunk to fit
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # the share of examples whose continuation the draft samples itself (at ``sample_temperature``);
    # the rest use the target's greedy output for the same frame (computed once, then cached)
    on_policy: float = 0.5
    sample_temperature: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0


@dataclass
class DistillExample:
    """One training sequence: the prompt (``instruction`` + ``image``, after the earlier decisions
    ``history`` for a policy with memory), then ``tokens`` (text token
    ids after the prompt). The loss covers ``n_rows`` next-token distributions from the one that
    predicts ``tokens[loss_from]`` on (``loss_from + n_rows <= len(tokens) + 1``: the last row may
    predict the token after ``tokens``). ``target_topk`` (ids, log-probs; each n_rows x k) is the
    target's distribution at those rows when it is known (a recorded trace); None: the target
    computes it in process."""

    instruction: str
    image: np.ndarray
    tokens: list[int]
    loss_from: int = 0
    n_rows: int = 0
    target_topk: tuple[np.ndarray, np.ndarray] | None = None
    history: tuple = ()

    def __post_init__(self):
        if not self.n_rows:
            self.n_rows = len(self.tokens) - self.loss_from
        if self.loss_from < 0 or self.n_rows < 1 or self.loss_from + self.n_rows > len(self.tokens) + 1:
            raise ValueError(f"DistillExample: rows [{self.loss_from}, {self.loss_from + self.n_rows}) do not fit "
                             f"{len(self.tokens)} tokens")


def divergence(draft_logits: torch.Tensor, target_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over rows of the divergence ``kind`` (``DIVERGENCES``) between the target's
    distribution (log-probabilities, rows x vocab, each row normalised) and the draft's (logits)."""
    q_log = F.log_softmax(draft_logits.float(), dim=-1)
    p_log = target_logprobs.float()
    if kind == "fkl":
        p = p_log.exp()
        return (p * (p_log - q_log)).sum(-1).mean()
    if kind == "rkl":
        q = q_log.exp()
        return (q * (q_log - p_log)).sum(-1).mean()
    if kind == "tvd":
        return 0.5 * (p_log.exp() - q_log.exp()).abs().sum(-1).mean()
    raise ValueError(f"divergence {kind!r} is not one of {DIVERGENCES}")


def dense_logprobs(topk_ids: np.ndarray, topk_logprobs: np.ndarray, vocab_size: int,
                   floor: float = 1e-6) -> torch.Tensor:
    """Full-vocabulary log-probabilities from a top-k record (rows x k): the recorded mass where it
    was recorded, the rest (at least ``floor``) spread evenly over the other tokens, so that every
    divergence (the reverse KL too) stays finite."""
    rows, k = topk_ids.shape
    p = np.exp(topk_logprobs.astype(np.float64))
    rest = np.maximum(1.0 - p.sum(1, keepdims=True), floor)
    out = np.repeat(rest / max(1, vocab_size - k), vocab_size, axis=1)
    np.put_along_axis(out, topk_ids.astype(np.int64), p, axis=1)
    out /= out.sum(1, keepdims=True)
    return torch.from_numpy(np.log(out)).float()


def vision_token_ids(tokenizer) -> set[int]:
    """The ids that mark image positions: a text continuation holding one would be read as an
    image slot by Qwen2-VL's forward pass (a sampled draft can emit them; they are cut there)."""
    ids = {tokenizer.convert_tokens_to_ids(t) for t in (IMAGE_PAD, VISION_START, VISION_END)}
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def _prompt(lm, example: DistillExample):
    return build_inputs(lm.tokenizer, example.instruction, example.image, lm.image_processor, processor=lm.processor,
                        history=example.history)


def prompt_history(prompt) -> tuple:
    """A prompt's earlier decisions: prompts are (instruction, image) or, for a policy with memory
    (``decoding.memory``), (instruction, image, history)."""
    return tuple(prompt[2]) if len(prompt) > 2 else ()


def batch_logits(lm, examples: list[DistillExample]) -> torch.Tensor:
    """The model's logits at every example's loss rows, stacked (sum of n_rows, vocab), in example
    order: one right-padded forward pass. Gradients flow when enabled by the caller."""
    prompts = [_prompt(lm, e) for e in examples]
    seqs = [p.input_ids[0].tolist() + list(e.tokens) for p, e in zip(prompts, examples)]
    length = max(len(s) for s in seqs)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, (s, p) in enumerate(zip(seqs, prompts)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        if p.mm_token_type_ids is not None:
            types[i, :p.num_tokens] = p.mm_token_type_ids[0]
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if prompts[0].pixel_values is not None:
        kwargs.update(pixel_values=torch.cat([p.pixel_values for p in prompts]),
                      image_grid_thw=torch.cat([p.image_grid_thw for p in prompts]), mm_token_type_ids=types)
    dev = lm.device
    logits = lm.model(**{k: v.to(dev) for k, v in kwargs.items()}).logits
    rows = [(i, p.num_tokens - 1 + e.loss_from + r) for i, (p, e) in enumerate(zip(prompts, examples))
            for r in range(e.n_rows)]
    b, pos = zip(*rows)
    return logits[torch.tensor(b, device=dev), torch.tensor(pos, device=dev)]


@torch.no_grad()
def generate(lm, prompts: list[tuple[str, np.ndarray]], max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> list[list[int]]:
    """Continuations of (instruction, image[, history]) prompts, batched (left-padded), greedy at temperature 0
    else sampled from the untruncated softmax at ``temperature``; each ends with the model's
    end-of-turn token when it produced one within ``max_new_tokens``."""
    built = [build_inputs(lm.tokenizer, p[0], p[1], lm.image_processor, processor=lm.processor,
                          history=prompt_history(p)) for p in prompts]
    length = max(p.num_tokens for p in built)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(built), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    types = torch.zeros_like(ids)
    for i, p in enumerate(built):
        ids[i, length - p.num_tokens:] = p.input_ids[0]
        mask[i, length - p.num_tokens:] = 1
        if p.mm_token_type_ids is not None:
            types[i, length - p.num_tokens:] = p.mm_token_type_ids[0]
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if built[0].pixel_values is not None:
        kwargs.update(pixel_values=torch.cat([p.pixel_values for p in built]),
                      image_grid_thw=torch.cat([p.image_grid_thw for p in built]), mm_token_type_ids=types)
    eos = sorted(lm.eos_token_ids)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    torch.manual_seed(seed)
    out = lm.model.generate(**{k: v.to(lm.device) for k, v in kwargs.items()}, max_new_tokens=max_new_tokens,
                            pad_token_id=pad, eos_token_id=eos, **sampling)
    vision = vision_token_ids(lm.tokenizer)
    result = []
    for row in out[:, length:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in lm.eos_token_ids), len(row))
        row = row[:cut]
        result.append(row[:next((i for i, t in enumerate(row) if t in vision), len(row))])
    return result


@dataclass
class DistillLog:
    steps: int = 0
    seconds: float = 0.0
    losses: list = field(default_factory=list)
    on_policy_tokens: int = 0
    teacher_tokens: int = 0


class GreedyCache:
    """The target's greedy continuation of each prompt, computed once in batches (the teacher half
    of the training mix, and the reference sequence of :func:`agreement`)."""

    def __init__(self, target, max_new_tokens: int, batch_size: int = 16):
        self.target, self.max_new_tokens, self.batch_size = target, max_new_tokens, batch_size
        self._done: dict[int, list[int]] = {}

    def get(self, prompts: list[tuple[str, np.ndarray]], keys: list[int]) -> list[list[int]]:
        missing = [i for i, k in enumerate(keys) if k not in self._done]
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start:start + self.batch_size]
            for i, cont in zip(chunk, generate(self.target, [prompts[i] for i in chunk], self.max_new_tokens)):
                self._done[keys[i]] = cont
        return [self._done[k] for k in keys]


def distill(draft, target, prompts: list[tuple[str, np.ndarray]], cfg: DistillConfig, desc: str = "distill",
            traces: list[DistillExample] | None = None) -> DistillLog:
    """Train ``draft`` (a LoadedModel, in place) towards ``target`` on the (instruction, image)
    ``prompts``: each step draws ``cfg.batch_size`` prompts; a share ``cfg.on_policy`` of them get a
    continuation sampled from the draft, the others the target's greedy one; the loss is
    ``cfg.divergence`` to the target's distributions at every continuation position. With
    ``traces`` (examples that carry the target's top-k) batches are drawn from those
    instead and ``target`` may be None. Returns the training log; the draft is left in eval mode."""
    from tqdm import tqdm
    from .trainer import budgeted_total, lr_at
    if cfg.divergence not in DIVERGENCES:
        raise ValueError(f"divergence {cfg.divergence!r} is not one of {DIVERGENCES}")
    if traces is None and (target is None or not prompts):
        raise ValueError("distill: give prompts and a target, or trace examples")
    if traces is not None and not traces:
        raise ValueError("distill: no trace examples to learn from")
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    teacher = GreedyCache(target, cfg.max_new_tokens, cfg.batch_size) if target is not None else None
    model = draft.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    log = DistillLog()
    started = time.monotonic()
    total = cfg.steps
    bar = tqdm(range(cfg.steps), desc=desc, unit="step", dynamic_ncols=True)
    try:
        for step in bar:
            total = budgeted_total(step, cfg, total, started)
            if total is None:
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg, total)
            model.eval()  # drafting continuations and the target's side: no dropout, no grad
            if traces is not None:
                batch = [traces[i] for i in rng.choice(len(traces), min(cfg.batch_size, len(traces)), replace=False)]
            else:
                batch = _draw_batch(draft, teacher, prompts, cfg, rng, step, log)
                if not batch:  # every continuation ended at once: nothing to learn from these frames
                    continue
            if any(e.target_topk is None for e in batch):
                with torch.no_grad():
                    p_log = F.log_softmax(batch_logits(target, batch).float(), dim=-1)
            else:  # densified per batch: a 151k-token vocabulary would not fit for a whole trace set
                p_log = torch.cat([dense_logprobs(*e.target_topk, draft.vocab_size) for e in batch]).to(draft.device)
            model.train()
            loss = divergence(batch_logits(draft, batch), p_log, cfg.divergence)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            log.losses.append(float(loss.item()))
            log.steps = step + 1
            if step % 10 == 0:
                bar.set_postfix(**{cfg.divergence: f"{np.mean(log.losses[-10:]):.4f}"},
                                lr=f"{opt.param_groups[0]['lr']:.1e}")
    finally:
        bar.close()
        model.eval()
    log.seconds = round(time.monotonic() - started, 1)
    return log


def _draw_batch(draft, teacher: GreedyCache, prompts, cfg: DistillConfig, rng, step: int,
                log: DistillLog) -> list[DistillExample]:
    """A batch of prompts, each with an on-policy (draft-sampled) or teacher (target-greedy)
    continuation; empty continuations are dropped (a model that ends at once has nothing to learn
    from that frame)."""
    picked = rng.choice(len(prompts), min(cfg.batch_size, len(prompts)), replace=False).tolist()
    own = rng.random(len(picked)) < cfg.on_policy
    chosen = [prompts[i] for i in picked]
    conts: list = [None] * len(picked)
    mine = [j for j in range(len(picked)) if own[j]]
    if mine:
        for j, c in zip(mine, generate(draft, [chosen[j] for j in mine], cfg.max_new_tokens,
                                       cfg.sample_temperature, seed=cfg.seed * 1_000_003 + step)):
            conts[j] = c
            log.on_policy_tokens += len(c)
    theirs = [j for j in range(len(picked)) if not own[j]]
    if theirs:
        for j, c in zip(theirs, teacher.get([chosen[j] for j in theirs], [picked[j] for j in theirs])):
            conts[j] = c
            log.teacher_tokens += len(c)
    return [DistillExample(p[0], p[1], c, history=prompt_history(p)) for p, c in zip(chosen, conts) if c]


@torch.no_grad()
def agreement(draft, target, prompts: list[tuple[str, np.ndarray]], teacher: GreedyCache | None = None,
              batch_size: int = 16) -> dict:
    """How well the draft predicts the target along the target's greedy continuations of held-out
    ``prompts`` (teacher-forced, every position): ``greedy_match`` (argmax equal: a token's
    acceptance at temperature 0), ``accept_t1`` (mean 1 - TV at temperature 1: its acceptance
    probability there), and the mean forward KL, reverse KL and TV."""
    teacher = teacher or GreedyCache(target, 64, batch_size)
    conts = teacher.get(prompts, list(range(len(prompts))))
    sums = {"greedy_match": 0.0, "accept_t1": 0.0, "fkl": 0.0, "rkl": 0.0, "tvd": 0.0}
    rows = 0
    for start in range(0, len(prompts), batch_size):
        batch = [DistillExample(p[0], p[1], c, history=prompt_history(p)) for p, c in
                 zip(prompts[start:start + batch_size], conts[start:start + batch_size]) if c]
        if not batch:
            continue
        q = batch_logits(draft, batch).float()
        p_log = F.log_softmax(batch_logits(target, batch).float(), dim=-1)
        q_log = F.log_softmax(q, dim=-1)
        tv = 0.5 * (p_log.exp() - q_log.exp()).abs().sum(-1)
        sums["greedy_match"] += float((q.argmax(-1) == p_log.argmax(-1)).sum())
        sums["accept_t1"] += float((1 - tv).sum())
        sums["tvd"] += float(tv.sum())
        sums["fkl"] += float((p_log.exp() * (p_log - q_log)).sum(-1).sum())
        sums["rkl"] += float((q_log.exp() * (q_log - p_log)).sum(-1).sum())
        rows += q.shape[0]
    return {k: v / max(1, rows) for k, v in sums.items()} | {"positions": rows, "prompts": len(prompts)}


def flops_per_token(lm) -> int:
    """~2 x the language model's non-embedding parameters: the forward FLOPs of one text token
    (the draft/target cost ratio the card states; the vision towers run once per frame)."""
    lang = lm.model.model.language_model if hasattr(lm.model.model, "language_model") else lm.model.model
    return 2 * sum(p.numel() for n, p in lang.named_parameters() if "embed" not in n) + \
        2 * lm.model.lm_head.weight.numel()


def param_count(lm) -> int:
    return sum(p.numel() for p in lm.model.parameters())


SD_GRID = ((2, 4, 6, 8), (0.0, 1.0))  # the card's gammas and temperatures, before and after distillation


def sd_table(draft_dir: str, target_dir: str, frames, grid=SD_GRID) -> list[dict]:
    """Real speculative decoding (in process) of the draft against the target on ``frames``: the
    acceptance rate and tau at every (gamma, temperature) of ``grid``."""
    from .card import sd_acceptance
    return [sd_acceptance(draft_dir, target_dir, frames, gamma, temperature)
            for gamma in grid[0] for temperature in grid[1]]


def run_distill_stage(draft_dir: str, target_dir: str, out_dir: str, prompts, heldout, sd_frames,
                      cfg: DistillConfig, device: str = "cpu", command: str = "") -> dict:
    """``edgespec-train distill``: distill the draft in ``draft_dir`` towards the target in
    ``target_dir`` on ``prompts`` and save it to ``out_dir`` (may be ``draft_dir``: in place, its
    ``training.json`` gains a ``distill`` entry). Measures before and after: teacher-forced
    agreement on the ``heldout`` prompts, and SD at the card's gammas and temperatures on
    ``sd_frames`` (examples with ``instruction`` and ``image``; none: skipped). Returns the report,
    also written to ``out_dir/distill.json``."""
    import json
    import os
    import shutil
    from ..decoding.engines import load_model
    draft, target = load_model(draft_dir, device=device), load_model(target_dir, device=device)
    if draft.fingerprint() != target.fingerprint():
        raise SystemExit(f"edgespec-train distill: {draft_dir} and {target_dir} do not share a vocabulary "
                         "(tokenizer fingerprints differ): speculative decoding needs one")
    teacher = GreedyCache(target, cfg.max_new_tokens, cfg.batch_size)
    report = {"command": command, "config": cfg.__dict__.copy(), "device": device,
              "draft_params": param_count(draft), "target_params": param_count(target),
              "draft_flops_per_token": flops_per_token(draft), "target_flops_per_token": flops_per_token(target),
              "train_prompts": len(prompts), "before": agreement(draft, target, heldout, teacher)}
    if sd_frames:
        report["sd_before"] = sd_table(draft_dir, target_dir, sd_frames)
    log = distill(draft, target, prompts, cfg)
    report.update(steps=log.steps, seconds=log.seconds, final_loss=float(np.mean(log.losses[-20:])),
                  on_policy_tokens=log.on_policy_tokens, teacher_tokens=log.teacher_tokens,
                  after=agreement(draft, target, heldout, teacher))
    if os.path.abspath(out_dir) != os.path.abspath(draft_dir):
        shutil.copytree(draft_dir, out_dir, dirs_exist_ok=True)
    draft.model.save_pretrained(out_dir)
    if sd_frames:
        report["sd_after"] = sd_table(out_dir, target_dir, sd_frames)
    with open(os.path.join(out_dir, "distill.json"), "w") as f:
        json.dump(report, f, indent=2)
    info_path = os.path.join(out_dir, "training.json")
    if os.path.isfile(info_path):
        with open(info_path) as f:
            info = json.load(f)
        info["distill"] = {k: report[k] for k in ("config", "steps", "seconds", "final_loss", "before", "after")}
        with open(info_path, "w") as f:
            json.dump(info, f, indent=2)
    return report


def format_report(report: dict) -> str:
    """The distillation report as a few lines: agreement before -> after, and the SD table."""
    b, a = report["before"], report["after"]
    lines = [f"distill ({report['config']['divergence']}, {report['steps']} steps, {report['seconds']:.0f} s): "
             f"held-out agreement with the target over {a['positions']} positions of {a['prompts']} frames",
             f"  greedy match {b['greedy_match']:.3f} -> {a['greedy_match']:.3f}   "
             f"accept at T=1 (1-TV) {b['accept_t1']:.3f} -> {a['accept_t1']:.3f}   "
             f"FKL {b['fkl']:.3f} -> {a['fkl']:.3f}   RKL {b['rkl']:.3f} -> {a['rkl']:.3f}"]
    for before, after in zip(report.get("sd_before", []), report.get("sd_after", [])):
        lines.append(f"  SD gamma {after['gamma']} T={after['temperature']:g}: acceptance "
                     f"{before['acceptance_rate']:.3f} -> {after['acceptance_rate']:.3f}, tau "
                     f"{before['tau']:.2f} -> {after['tau']:.2f} ({after['decisions']} decisions)")
    return "\n".join(lines)


def trace_examples(records, tokenizer) -> tuple[list[DistillExample], int]:
    """Training examples from recorded verify rounds (``cloud.traces.TraceRecord``) that carry
    their camera frame: the round's prompt as the target saw it (the instruction and, for a policy
    with memory, the earlier decisions read back from the recorded prompt ids), its context and
    drafts, the loss on the drafted positions and the bonus position, against the target's
    recorded top-k. Returns (examples, rounds skipped: no frame, a vision token among the drafts,
    or a prompt that is not the project's chat layout of the recorded instruction)."""
    from ..decoding.inputs import parse_prompt, to_pil
    vision = vision_token_ids(tokenizer)
    frames: dict[tuple[str, str], np.ndarray] = {}  # each decision's JPEG decoded once
    prompts: dict[tuple[str, str], tuple | None] = {}  # and its prompt read once
    examples, skipped = [], 0
    for r in records:
        key = (r.tenant, r.decision)
        if key not in prompts:
            prompts[key] = parse_prompt(tokenizer.decode(r.prompt_ids, skip_special_tokens=False))
        parsed = prompts[key]
        if r.jpeg is None or vision & set(r.context_ids + r.draft_ids) or parsed is None or parsed[0] != r.instruction:
            skipped += 1
            continue
        if key not in frames:
            frames[key] = np.asarray(to_pil(r.jpeg))
        n = len(r.draft_ids) + 1
        examples.append(DistillExample(r.instruction, frames[key], list(r.context_ids) + list(r.draft_ids),
                                       loss_from=len(r.context_ids), n_rows=n,
                                       target_topk=(r.target_topk_ids[:n], r.target_topk_logprobs[:n]),
                                       history=parsed[1]))
    return examples, skipped


def first_decisions(records, n: int | None) -> list:
    """The records of the first ``n`` decisions in recording order (None: all)."""
    if n is None:
        return list(records)
    keep: set = set()
    out = []
    for r in records:
        key = (r.tenant, r.decision)
        if key not in keep and len(keep) >= n:
            continue
        keep.add(key)
        out.append(r)
    return out


def adapt_from_traces(draft_dir: str, trace_dir: str, out_parent: str, cfg: DistillConfig,
                      device: str = "cpu", decisions: int | None = None) -> tuple[str, dict]:
    """``edgespec-train distill --traces DIR``: the draft in ``draft_dir`` adapted to a recording
    verifier's traffic, saved as a new model directory ``out_parent/draft-<content hash>`` (the
    hash HELLO will carry), from the first ``decisions`` recorded decisions (None: all). Returns
    (that path, the report also written there as adapt.json).
    Rounds recorded without images cannot be replayed through a vision draft and are skipped; a
    trace set with none is refused."""
    import json
    import os
    import shutil
    import tempfile
    from collections import Counter
    from ..decoding.engines import load_model, model_content_hash
    from ..cloud.traces import read_traces
    records = first_decisions(read_traces(trace_dir), decisions)
    draft = load_model(draft_dir, device=device)
    examples, skipped = trace_examples(records, draft.tokenizer)
    if not examples and any(r.jpeg is not None for r in records):
        raise SystemExit(f"edgespec-train distill: {trace_dir} holds {len(records)} recorded rounds and none usable: "
                         "those with a camera frame have a prompt that is not this project's chat layout "
                         "(decoding.inputs.chat_prompt) of their instruction, or an image token among their drafts")
    if not examples:
        raise SystemExit(f"edgespec-train distill: {trace_dir} holds {len(records)} recorded rounds and none with a "
                         "camera frame: a vision draft needs the frames it drafted from (record with "
                         "edgespec-verifier --record-traces DIR --record-images)")
    log = distill(draft, None, [], cfg, desc="adapt", traces=examples)
    os.makedirs(out_parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".draft-", dir=out_parent)
    try:
        for name in os.listdir(draft_dir):  # tokenizer and processor files; the weights are replaced below
            src = os.path.join(draft_dir, name)
            if os.path.isfile(src) and name not in ("training.json", "distill.json", "adapt.json"):
                shutil.copy2(src, staging)
        draft.model.save_pretrained(staging)
        digest = model_content_hash(staging)
        report = {"source_draft": draft.content_hash, "adapted_draft": digest, "traces": os.path.abspath(trace_dir),
                  "rounds": len(records), "rounds_used": len(examples), "rounds_without_frame": skipped,
                  "decisions": len({(r.tenant, r.decision) for r in records}),
                  "recorded_by_draft": dict(Counter(r.draft_hash or "?" for r in records)),
                  "config": cfg.__dict__.copy(), "steps": log.steps, "seconds": log.seconds,
                  "final_loss": float(np.mean(log.losses[-20:]))}
        with open(os.path.join(staging, "adapt.json"), "w") as f:
            json.dump(report, f, indent=2)
        final = os.path.join(out_parent, f"draft-{digest}")
        if os.path.isdir(final):  # the same weights again: keep the first copy
            shutil.rmtree(staging)
        else:
            os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final, report
