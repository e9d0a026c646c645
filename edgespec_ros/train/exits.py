"""Train and measure early-exit adapters on a frozen target (FSD paper Fig. 3 and Fig. 7).

Each adapter is trained to make its exit agree with the target's final layer: the loss is the
KL divergence from the final layer's next-token distribution to the exit's, on the answer tokens
of the simulator's expert texts (teacher forcing). The target's weights are frozen and every
adapter sees detached hidden states, so each adapter's loss updates that adapter alone.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..decoding.engines import LoadedModel
from ..decoding.exits import EarlyExits, ExitHooks
from .data import IGNORE, collate, encode_example


@dataclass
class ExitTrainConfig:
    steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    rank: int = 0  # adapter bottleneck width; 0: hidden // 4
    layers: str = ""  # comma-separated exit layers; empty: every layer but the last
    seed: int = 0


def _answer_rows(batch: dict) -> torch.Tensor:
    """Mask over logits[:, :-1] rows that predict an answer token (labels shifted by one)."""
    return batch["labels"][:, 1:] != IGNORE


def _forward_exits(model, hooks: ExitHooks, batch: dict) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    exit_logits: dict[int, torch.Tensor] = {}
    hooks.callback = lambda layer, z: exit_logits.__setitem__(layer, z)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        final = model(**inputs).logits.float()
    hooks.callback = None
    return final, exit_logits


def train_exits(lm: LoadedModel, examples, cfg: ExitTrainConfig, desc: str = "exits: train") -> tuple[EarlyExits, list[float]]:
    """Adapters for lm's target trained on encoded examples; returns (exits, per-step losses)."""
    from tqdm import tqdm
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    model = lm.model.eval().requires_grad_(False)
    layers = [int(x) for x in cfg.layers.split(",") if x.strip()] or None
    exits = EarlyExits.for_model(model, layers, cfg.rank or None)
    exits.train()
    opt = torch.optim.AdamW(exits.parameters(), lr=cfg.lr, weight_decay=0.0)
    losses = []
    with ExitHooks(model, exits, train=True) as hooks:
        hooks.rows = None
        bar = tqdm(range(cfg.steps), desc=desc, unit="step", dynamic_ncols=True)
        for step in bar:
            for g in opt.param_groups:  # cosine decay after a short warm-up
                g["lr"] = cfg.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + np.cos(np.pi * step / cfg.steps))
            idx = rng.choice(len(examples), size=min(cfg.batch_size, len(examples)), replace=False)
            batch = collate([examples[i] for i in idx], lm.tokenizer, lm.image_processor)
            rows = _answer_rows(batch)
            final, exit_logits = _forward_exits(model, hooks, batch)
            target = torch.log_softmax(final[:, :-1][rows], dim=-1)
            loss = 0.0
            for z in exit_logits.values():  # independent adapters: the sum's gradient is per adapter
                logp = torch.log_softmax(z[:, :-1][rows], dim=-1)
                loss = loss + torch.sum(target.exp() * (target - logp), dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item() / len(exit_logits))
            if step % 10 == 0:
                bar.set_postfix(kl=f"{np.mean(losses[-10:]):.3f}")
        bar.close()
    exits.eval().requires_grad_(False)
    return exits, losses


@torch.inference_mode()
def measure_exits(lm: LoadedModel, exits: EarlyExits, examples, batch_size: int = 16) -> list[dict]:
    """Fig. 7: per exit layer, the token match rate with the final layer and the mean confidence
    (max softmax probability) over the answer tokens of held-out examples; the final layer last."""
    model = lm.model.eval()
    match = {layer: 0 for layer in exits.layers}
    conf = {layer: 0.0 for layer in exits.layers}
    final_conf, n = 0.0, 0
    with ExitHooks(model, exits) as hooks:
        hooks.rows = None
        for i in range(0, len(examples), batch_size):
            batch = collate(examples[i:i + batch_size], lm.tokenizer, lm.image_processor)
            rows = _answer_rows(batch)
            final, exit_logits = _forward_exits(model, hooks, batch)
            f = torch.softmax(final[:, :-1][rows], dim=-1)
            top = f.argmax(-1)
            final_conf += float(f.max(-1).values.sum())
            n += int(rows.sum())
            for layer, z in exit_logits.items():
                p = torch.softmax(z[:, :-1][rows], dim=-1)
                match[layer] += int((p.argmax(-1) == top).sum())
                conf[layer] += float(p.max(-1).values.sum())
    out = [{"layer": layer, "match_rate": match[layer] / n, "confidence": conf[layer] / n} for layer in exits.layers]
    out.append({"layer": exits.num_layers, "match_rate": 1.0, "confidence": final_conf / n, "final": True})
    return out


def format_exit_table(rows: list[dict], untrained: list[dict] | None = None) -> str:
    head = "| exit layer | token match with final | mean confidence |" + (" match, untrained (logit lens) |" if untrained else "")
    sep = "|---|---|---|" + ("---|" if untrained else "")
    lines = [head, sep]
    for i, r in enumerate(rows):
        name = f"{r['layer']} (final)" if r.get("final") else str(r["layer"])
        line = f"| {name} | {100 * r['match_rate']:.1f}% | {r['confidence']:.3f} |"
        if untrained:
            line += f" {100 * untrained[i]['match_rate']:.1f}% |"
        lines.append(line)
    return "\n".join(lines)


def plot_exits(rows: list[dict], path: str, title: str, untrained: list[dict] | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layers = [r["layer"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(layers, [100 * r["match_rate"] for r in rows], "o-", label="token match with final (%)")
    if untrained:
        ax.plot(layers, [100 * r["match_rate"] for r in untrained], "x--", color="gray",
                label="match, untrained adapters (logit lens)")
    ax.set_xlabel("exit layer")
    ax.set_ylabel("token match (%)")
    ax.set_ylim(0, 105)
    ax2 = ax.twinx()
    ax2.plot(layers, [r["confidence"] for r in rows], "s-", color="tab:orange", label="mean confidence")
    ax2.set_ylabel("mean confidence (max softmax)")
    ax2.set_ylim(0, 1.05)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="lower right", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_exits_stage(target_dir: str, out_dir: str | None, examples_train, examples_eval, cfg: ExitTrainConfig,
                    command: str = "") -> dict:
    """Train, measure, save (safetensors + exits.json + README.md + exits.png) beside the target."""
    from ..decoding.engines import load_model
    lm = load_model(target_dir)
    out_dir = out_dir or os.path.join(target_dir, "exits")
    encode = lambda exs: [encode_example(lm.tokenizer, lm.image_processor, e.image, e.instruction, e.text,  # noqa: E731
                                         history=getattr(e, "history", ())) for e in exs]
    train_enc, eval_enc = encode(examples_train), encode(examples_eval)
    t0 = time.monotonic()
    exits, losses = train_exits(lm, train_enc, cfg)
    seconds = time.monotonic() - t0
    rows = measure_exits(lm, exits, eval_enc)
    untrained = measure_exits(lm, EarlyExits.for_model(lm.model, exits.layers, exits.rank).eval(), eval_enc)
    meta = {"training": asdict(cfg) | {"train_seconds": round(seconds, 1), "final_kl": float(np.mean(losses[-20:])),
                                        "examples": len(train_enc)},
            "params": sum(p.numel() for p in exits.parameters()),
            "target_params": sum(p.numel() for p in lm.model.parameters()),
            "metrics": {"heldout_examples": len(eval_enc), "per_exit": rows, "untrained_per_exit": untrained}}
    exits.save(out_dir, lm.fingerprint(), meta)
    plot_exits(rows, os.path.join(out_dir, "exits.png"), f"Early exits of {os.path.basename(os.path.normpath(target_dir))}"
               " (held-out frames)", untrained)
    table = format_exit_table(rows, untrained)
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(f"# Early-exit adapters\n\nAdapters after decoder layers {exits.layers} of the target "
                f"({exits.num_layers} layers), rank {exits.rank}: {meta['params']:,} parameters "
                f"({100 * meta['params'] / meta['target_params']:.2f}% of the target), trained "
                f"{cfg.steps} steps x {cfg.batch_size} in {seconds:.0f} s on {len(train_enc)} simulator examples "
                "(target frozen; each adapter distils the final layer's distribution).\n\n"
                f"Measured on {len(eval_enc)} held-out frames (teacher-forced expert answers), as in the FSD "
                "paper's Fig. 7:\n\n" + table + "\n\n![exits](exits.png)\n\n"
                f"Reproduce: `{command or 'edgespec-train exits --target ' + target_dir}`\n")
    print(table)
    print(f"exits: {meta['params']:,} params, {seconds:.0f} s -> {out_dir}")
    return meta
