"""Early-exit adapters on the target (FSD paper Fig. 3, Eq. 3-5).

One small residual adapter after each chosen decoder layer of the target feeds the target's own
final norm and LM head:  z^(l) = LMHead(Norm(h^(l) + Up(SiLU(Down(h^(l))))))  with Up initialised
to zero (so an untrained exit is the plain "logit lens"). Base weights stay frozen; each adapter's
loss only reaches that adapter. Exits never commit tokens: they only let the robot guess the
verdict early (robot.predraft); the final layer alone decides.

``ExitHooks`` computes exit logits *during* the target's forward pass (a forward hook per exit
layer), so a verifier can stream each exit's verification while the deeper layers still run.
Works on any Qwen2-VL / Qwen2-style causal LM (the real 7B included).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from .preempt import owned_hook

EXITS_WEIGHTS = "exits.safetensors"
EXITS_CONFIG = "exits.json"


class ExitLoadError(RuntimeError):
    """Adapters missing, malformed, or trained for another target."""


def text_stack(model: nn.Module) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(decoder layers, final norm, LM head) of a Qwen2-VL or Qwen2-style causal LM."""
    inner = getattr(model, "model", None)
    lm = getattr(inner, "language_model", None) or inner
    layers, norm = getattr(lm, "layers", None), getattr(lm, "norm", None)
    head = model.get_output_embeddings()
    if not isinstance(layers, nn.ModuleList) or norm is None or head is None:
        raise ExitLoadError(f"cannot find decoder layers / final norm / LM head in {type(model).__name__}")
    return layers, norm, head


def forward_stages(model: nn.Module) -> list[nn.Module]:
    """Where a forward of a Qwen2-VL or Qwen2-style model may pause (``preempt.install_checkpoints``):
    before each decoder layer after the first, the final norm (the LM head's input), and each block
    of the vision tower after the first and its merger; [] for another architecture."""
    try:
        layers, norm, _ = text_stack(model)
    except ExitLoadError:
        return []
    stages = list(layers)[1:] + [norm]
    visual = getattr(getattr(model, "model", None), "visual", None) or getattr(model, "visual", None)
    blocks = getattr(visual, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        stages += list(blocks)[1:] + [m for m in [getattr(visual, "merger", None)] if m is not None]
    return stages


class ExitAdapter(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, hidden, bias=False)
        nn.init.normal_(self.down.weight, std=1.0 / math.sqrt(hidden))
        nn.init.zeros_(self.up.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(nn.functional.silu(self.down(h)))


@dataclass
class ExitResult:
    """One exit's verification of a draft (Eq. 5) and its confidence (Eq. 4)."""

    layer: int
    accepted: int
    next_token: int
    confidence: float  # max softmax probability of the exit at the position of its next token

    @property
    def key(self) -> tuple[int, int]:
        return self.accepted, self.next_token


class EarlyExits(nn.Module):
    """Adapters for a set of decoder layers (1-based: exit l sits after decoder layer l)."""

    def __init__(self, hidden: int, num_layers: int, layers: list[int], rank: int):
        super().__init__()
        layers = sorted(set(int(x) for x in layers))
        if not layers or layers[0] < 1 or layers[-1] >= num_layers:
            raise ValueError(f"exit layers must be within 1..{num_layers - 1} (the last layer is the final "
                             f"output), got {layers}")
        if rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {rank}")
        self.hidden, self.num_layers, self.layers, self.rank = hidden, num_layers, layers, rank
        self.adapters = nn.ModuleDict({str(layer): ExitAdapter(hidden, rank) for layer in layers})
        self.meta: dict = {}

    @classmethod
    def for_model(cls, model: nn.Module, layers: list[int] | None = None, rank: int | None = None) -> "EarlyExits":
        decoder, _, _ = text_stack(model)
        hidden = model.get_output_embeddings().weight.shape[1]
        n = len(decoder)
        layers = list(range(1, n)) if layers is None else layers
        return cls(hidden, n, layers, rank or max(8, hidden // 4))

    def logits(self, layer: int, hidden_states: torch.Tensor, norm: nn.Module, head: nn.Module) -> torch.Tensor:
        return head(norm(self.adapters[str(layer)](hidden_states)))

    # --- files -----------------------------------------------------------------------------

    def save(self, directory: str, fingerprint: str, meta: dict | None = None) -> None:
        from safetensors.torch import save_file
        os.makedirs(directory, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  os.path.join(directory, EXITS_WEIGHTS))
        cfg = {"format": "edgespec-exits/1", "hidden": self.hidden, "num_layers": self.num_layers,
               "layers": self.layers, "rank": self.rank, "target_fingerprint": fingerprint, **(meta or {})}
        with open(os.path.join(directory, EXITS_CONFIG), "w") as f:
            json.dump(cfg, f, indent=2)

    @classmethod
    def load(cls, directory: str, model: nn.Module, fingerprint: str | None = None) -> "EarlyExits":
        """Load adapters for `model`; refuses adapters trained for another architecture or tokenizer."""
        from safetensors.torch import load_file
        cfg_path, w_path = os.path.join(directory, EXITS_CONFIG), os.path.join(directory, EXITS_WEIGHTS)
        if not os.path.isfile(cfg_path) or not os.path.isfile(w_path):
            raise ExitLoadError(f"no early-exit adapters in {directory!r} (need {EXITS_CONFIG} and {EXITS_WEIGHTS}; "
                                "train them with `edgespec-train exits --target DIR`)")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
            decoder, _, head = text_stack(model)
            hidden, n = head.weight.shape[1], len(decoder)
            if cfg["hidden"] != hidden or cfg["num_layers"] != n:
                raise ExitLoadError(f"adapters in {directory!r} are for hidden {cfg['hidden']} x {cfg['num_layers']} "
                                    f"layers, the target has hidden {hidden} x {n} layers")
            if fingerprint and cfg.get("target_fingerprint") not in (None, fingerprint):
                raise ExitLoadError(f"adapters in {directory!r} were trained for another tokenizer/target")
            exits = cls(hidden, n, cfg["layers"], cfg["rank"])
            exits.load_state_dict(load_file(w_path))
        except ExitLoadError:
            raise
        except Exception as exc:
            raise ExitLoadError(f"cannot load early-exit adapters from {directory!r}: {type(exc).__name__}: {exc}") from exc
        exits.meta = cfg
        param = next(model.parameters())
        return exits.to(device=param.device, dtype=param.dtype).eval().requires_grad_(False)


class ExitHooks:
    """Forward hooks that turn each exit layer's hidden states into exit logits mid-forward.

    ``rows`` picks which positions of the current forward to keep (the last ``rows`` ones, or
    all with None), ``select`` which batch rows (all with None; a batched verification computes
    exits only for the sessions that stream them); ``callback(layer, logits [batch, rows, V])``
    runs inside the forward pass, in
    layer order, so a verifier can verify and stream exit l while layers > l still compute. With
    ``train=True`` the adapters get gradients (the base forward may run under no_grad: its hidden
    states are detached, so each adapter's loss reaches that adapter only, as in Fig. 3).
    """

    def __init__(self, model: nn.Module, exits: EarlyExits, train: bool = False):
        self.exits = exits
        self.decoder, self.norm, self.head = text_stack(model)
        self.rows: int | None = 1
        self.select: list[int] | None = None  # batch rows to compute exits for (None: all)
        self.train = train
        self.callback = None
        self._handles = []

    def __enter__(self):
        for layer in self.exits.layers:  # never fired by another job's forward run while this one is paused
            self._handles.append(self.decoder[layer - 1].register_forward_hook(owned_hook(self._hook(layer))))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            if self.callback is None:
                return
            hs = (output[0] if isinstance(output, tuple) else output).detach()
            if self.select is not None:
                hs = hs[self.select]
            if self.rows is not None:
                hs = hs[:, -self.rows:]
            with torch.set_grad_enabled(self.train):
                logits = self.exits.logits(layer, hs, self.norm, self.head).float()
            self.callback(layer, logits)  # on the model's device, where the verifier's rule runs
        return hook


def default_exits_dir(model_path: str) -> str:
    """Adapters live beside the target: <model>/exits."""
    return os.path.join(model_path, "exits")


def attach_exits(lm, spec: str | None = "auto") -> EarlyExits | None:
    """Load early-exit adapters onto a LoadedModel target: ``auto`` (those beside the model if
    present), ``none``, or a directory (an error if it holds no adapters for this target)."""
    if spec in (None, "none"):
        lm.exits = None
        return None
    directory = default_exits_dir(lm.path) if spec == "auto" else spec
    if spec == "auto" and not os.path.isfile(os.path.join(directory, EXITS_CONFIG)):
        lm.exits = None
        return None
    lm.exits = EarlyExits.load(directory, lm.model, lm.fingerprint())
    return lm.exits
