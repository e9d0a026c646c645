"""``--sweep split-tv``: how lossy the split codec's top-K downlink is on the embedded models.

For held-out frames the target decodes alone (T = 1); at every generated position both models
give their distributions (teacher forcing) and ``codecs.split.separate_output_tv`` computes the
total-variation distance from the target's distribution of the output of a drafted position
whose rejection is resampled from the top-K-sparsified p (K = 0: the exact dense downlink).
"""
from __future__ import annotations

import numpy as np
import torch

from ..codecs.split import separate_output_tv
from ..robot.decoder import EdgeDecoder
from ..robot.settings import DecodeConfig
from ..cloud.local import LocalVerifier
from ..cloud.target import target_generate
from ..decoding.engines import load_model
from ..decoding.sampling import SamplingParams
from .runner import prompt_parts

KS = [0, 1, 3, 8, 32, 128]


@torch.inference_mode()
def run(opts, progress) -> list[dict]:
    draft, target = load_model(opts.pair.draft_path), load_model(opts.pair.target_path)
    decoder = EdgeDecoder(draft, LocalVerifier(target))
    ks = KS
    temperature = (opts.temperatures or [1.0])[0]
    prompts = opts.prompts(opts.decisions or 10)
    tv = {k: [] for k in ks}
    bar = progress(len(prompts))
    for i, prompt in enumerate(prompts):
        _, inputs = decoder.make_prompt(*prompt_parts(prompt))
        cfg = DecodeConfig(params=SamplingParams(temperature), seed=opts.seed + i, max_new_tokens=opts.max_new_tokens)
        gen = target_generate(target, inputs, cfg)
        ids = torch.cat([inputs.input_ids, torch.tensor([gen])], 1)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
        if inputs.pixel_values is not None:
            kw.update(pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                      mm_token_type_ids=torch.cat([inputs.mm_token_type_ids,
                                                   torch.zeros(1, len(gen), dtype=torch.long)], 1))
        n = inputs.num_tokens
        params = SamplingParams(temperature)
        from ..decoding.sampling import probs_from_logits
        p = probs_from_logits(target.model(**kw).logits[0, n - 1:-1].double(), params)
        q = probs_from_logits(draft.model(**kw).logits[0, n - 1:-1].double(), params)
        for k in ks:
            tv[k] += [separate_output_tv(p[j], q[j], k) for j in range(len(gen))]
        bar.update(1)
    bar.close()
    return [{"k": k, "codec": "split" if k == 0 else f"split:k={k}", "temperature": temperature,
             "positions": len(tv[k]), "mean_tv": float(np.mean(tv[k])), "p95_tv": float(np.percentile(tv[k], 95)),
             "max_tv": float(np.max(tv[k])), "downlink_bytes_per_rejection": 8 * (target.vocab_size if k == 0 else k)}
            for k in ks]


def table(rows: list[dict]) -> str:
    from .report import fixed_width
    return fixed_width(["codec", "positions", "mean TV", "p95 TV", "max TV", "down B/rejection"],
                       [[r["codec"], str(r["positions"]), f"{r['mean_tv']:.2e}", f"{r['p95_tv']:.2e}",
                         f"{r['max_tv']:.2e}", str(r["downlink_bytes_per_rejection"])] for r in rows])


def plot(rows: list[dict], path: str) -> None:
    from .fsd import _plt, _save
    plt = _plt()
    sparse = [r for r in rows if r["k"] > 0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.loglog([r["k"] for r in sparse], [max(r["mean_tv"], 1e-12) for r in sparse], "o-", label="mean TV")
    ax.loglog([r["k"] for r in sparse], [max(r["max_tv"], 1e-12) for r in sparse], "s--", label="max TV")
    ax.set_xlabel("K (top-K of p sent down on a rejection)")
    ax.set_ylabel("TV distance from the target")
    ax.legend(fontsize=8)
    ax.set_title(f"split codec: loss of the top-K downlink (T={rows[0]['temperature']:g}; exact split: 0)",
                 fontsize=10)
    _save(fig, path)
