"""LoRA adapters on model.py's network: settings, putting an adapter on a built model, its
place in checkpoints, and merging it (library; no side effects; peft is imported only where
an adapter is put on a model).

The adapter is peft's own LoRA layer (``peft.inject_adapter_in_model``: each targeted
``nn.Linear`` becomes ``peft.tuners.lora.Linear``, y = W x + (alpha / r) B A dropout(x), A
Kaiming-uniform, B zero, so a new adapter starts as the identity). Only A and B train: every
other parameter is frozen, so the trainer's optimizer (built over ``requires_grad``
parameters) holds the adapter alone.

    settings = LoraSettings.from_config(cfg.lora)     the ``lora`` config section, checked
    apply(model, settings)                            adapter on the built model (its weights loaded)
    settings_of(model)                                the model's adapter settings, or None
    base, weights = split_state(model)                base weights under plain names + A and B
    checkpoint_entries(model)                         ``{"lora": entry}`` for a checkpoint ({} without)
    load_weights(model, ckpt)                         a checkpoint's base weights and adapter into it
    check_entry(entry, shapes)                        a stored or read adapter, validated
    merged(base, entry)                               W + scale * B @ A for every adapted weight

Names. Targets are said as in Hugging Face's Llama (``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``: what peft users type) or as ours
(``wq`` ... ``w_down``), or ``all-linear`` (all seven); they are kept as Hugging Face names.
Adapter tensors are named as ours: ``layers.{i}.attn.wq.lora_A.weight`` (r, in) and
``...lora_B.weight`` (out, r); utils/hf/adapter.py writes and reads them in PEFT's own folder
format under the names of our Hugging Face export.

Checkpoints of a LoRA run (DESIGN.md section 8): ``"model"`` holds the base weights under plain
names (the file stands alone and the one loader validates it as any other), ``"lora"`` the
entry ``{rank, alpha, dropout, target_modules, rslora, weights}``. utils.run.load_checkpoint
merges the entry into ``"model"`` for every reader of weights (infer, serve, benchmark,
export, a new fine-tune); a resume gets them apart, so the adapter and its optimizer state
continue exactly.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import torch
import torch.nn as nn

from utils.cli import UsageError

# Hugging Face Llama's projection name -> the module path inside one of our blocks
TARGETS = {"q_proj": "attn.wq", "k_proj": "attn.wk", "v_proj": "attn.wv", "o_proj": "attn.wo",
           "gate_proj": "mlp.w_gate", "up_proj": "mlp.w_up", "down_proj": "mlp.w_down"}
ALL_LINEAR = "all-linear"
_OURS = {path.split(".")[-1]: hf for hf, path in TARGETS.items()}        # wq -> q_proj
_ADAPTER_KEY = re.compile(r"^layers\.(\d+)\.(attn\.w[qkvo]|mlp\.w_(?:gate|up|down))\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """One adapter's shape: rank r, alpha (scale alpha / r, or alpha / sqrt(r) with rslora),
    dropout on the adapter's input, and its targets (Hugging Face names, in TARGETS order)."""
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple = tuple(TARGETS)
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @classmethod
    def from_config(cls, section, key: str = "lora") -> "LoraSettings":
        """From the ``lora`` config section; an unknown target is a UsageError naming the key,
        the name and the valid ones."""
        return cls(rank=int(section.rank), alpha=float(section.alpha), dropout=float(section.dropout),
                   target_modules=targets_of(section.target_modules, f"{key}.target_modules"))

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "rslora": self.rslora}

    def describe(self) -> str:
        return (f"r={self.rank}, alpha={self.alpha:g}" + (" (rsLoRA)" if self.rslora else "")
                + f", dropout {self.dropout:g}, on {', '.join(self.target_modules)}")


def targets_of(names, key: str) -> tuple:
    """``names`` (HF names, ours, or ``all-linear``) as HF names in TARGETS order."""
    names = [names] if isinstance(names, str) else list(names)
    if ALL_LINEAR in names:
        return tuple(TARGETS)
    valid = ", ".join(list(TARGETS) + list(_OURS) + [ALL_LINEAR])
    if not names:
        raise UsageError(f"{key} is empty: name the projections the adapter goes on ({valid}).")
    chosen = set()
    for n in names:
        hf = n if n in TARGETS else _OURS.get(n)
        if hf is None:
            raise UsageError(f"{key}: unknown target module {n!r}; valid names are {valid} "
                             "(Hugging Face's Llama names or ours).")
        chosen.add(hf)
    return tuple(t for t in TARGETS if t in chosen)


def refusal(model_args) -> Optional[str]:
    """Why LoRA cannot go on this architecture (None: it can)."""
    if getattr(model_args, "attention", "standard") != "standard":
        return (f"LoRA is not supported on model.attention '{model_args.attention}' "
                "(Infini-attention's memory and gates read the projections' weights apart from "
                "their forward pass, and no Llama export carries them); fine-tune it in full "
                "(without --lora)")
    return None


# --------------------------------------------------------------------------- the model
def apply(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Put a new adapter (``settings``) on ``model`` in place, every other parameter frozen;
    call after the base weights are loaded (``model`` is returned)."""
    # peft imports transformers (about 4 s): only a LoRA run pays it
    from peft import LoraConfig, inject_adapter_in_model
    problem = refusal(getattr(model, "args", None))
    if problem:
        raise UsageError(problem + ".")
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=[TARGETS[t] for t in settings.target_modules],
                        use_rslora=settings.rslora, bias="none")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    model.lora_settings = settings
    return model


def settings_of(model: nn.Module) -> Optional[LoraSettings]:
    """The adapter ``apply`` put on ``model`` (None: a plain model)."""
    return getattr(model, "lora_settings", None)


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameters, each tensor once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def split_state(model: nn.Module) -> tuple[dict, dict]:
    """(base weights under plain names, adapter tensors under ours) of a model with an
    adapter; (its state dict, {}) of a plain one."""
    base, adapter = {}, {}
    for k, v in model.state_dict().items():
        if ".lora_A.default." in k or ".lora_B.default." in k:
            adapter[k.replace(".default.", ".")] = v
        else:
            base[k.replace(".base_layer.", ".")] = v
    return base, adapter


def checkpoint_entries(model: nn.Module) -> dict:
    """What a checkpoint holds beyond the base weights: ``{"lora": entry}``, or {}."""
    settings = settings_of(model)
    if settings is None:
        return {}
    return {"lora": {**settings.to_dict(), "weights": split_state(model)[1]}}


def load_weights(model: nn.Module, ckpt: dict) -> None:
    """A checkpoint's base weights (``"model"``) and, for a model with an adapter, the adapter
    (``"lora"``: unmerged, as a resume loads it) into ``model`` (strict)."""
    settings, entry = settings_of(model), ckpt.get("lora")
    if settings is None:
        if entry is not None:
            raise ValueError("the checkpoint holds a LoRA adapter but the model was built without one")
        model.load_state_dict(ckpt["model"], strict=True)
        return
    if entry is None:
        raise ValueError("the model has a LoRA adapter but the checkpoint holds none")
    stored = settings_from_entry(entry)
    if stored != settings:
        raise ValueError(f"the checkpoint's adapter ({stored.describe()}) is not the model's "
                         f"({settings.describe()})")
    adapted = {f"layers.{i}.{TARGETS[t]}" for i in range(len(model.layers)) for t in settings.target_modules}
    sd = {}
    for k, v in ckpt["model"].items():
        module = k.rsplit(".", 1)[0]
        sd[k.replace(".weight", ".base_layer.weight") if module in adapted else k] = v
    for k, v in entry["weights"].items():
        sd[k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")] = v
    model.load_state_dict(sd, strict=True)


# --------------------------------------------------------------------------- stored adapters
def settings_from_entry(entry: dict) -> LoraSettings:
    """The settings a checkpoint's (or a PEFT folder's) entry records; ValueError when damaged."""
    if not isinstance(entry, dict):
        raise ValueError("entry 'lora' is not a dict")
    rank, alpha, dropout = entry.get("rank"), entry.get("alpha"), entry.get("dropout", 0.0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank {rank!r} is not a positive integer")
    for what, x in (("alpha", alpha), ("dropout", dropout)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"lora {what} {x!r} is not a finite number")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora dropout {dropout!r} is not in [0, 1)")
    targets = entry.get("target_modules")
    if not isinstance(targets, (list, tuple)) or not targets or any(t not in TARGETS for t in targets):
        raise ValueError(f"lora target_modules {targets!r} are not among {', '.join(TARGETS)}")
    return LoraSettings(rank=rank, alpha=float(alpha), dropout=float(dropout),
                        target_modules=targets_of(list(targets), "lora.target_modules"),
                        rslora=bool(entry.get("rslora", False)))


def check_entry(entry: dict, shapes: dict) -> LoraSettings:
    """Validate an adapter entry against the base weights' ``shapes`` ({name: shape}): every
    targeted projection of every layer has A (r, in) and B (out, r), finite floating tensors,
    and nothing else; ValueError naming what is wrong. Returns its settings."""
    settings = settings_from_entry(entry)
    weights = entry.get("weights")
    if not isinstance(weights, dict):
        raise ValueError("lora weights are not a dict of tensors")
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"^layers\.(\d+)\.", k))})
    want = {f"layers.{i}.{TARGETS[t]}.lora_{ab}.weight": None
            for i in layers for t in settings.target_modules for ab in "AB"}
    extra = sorted(set(weights) - set(want))
    missing = sorted(set(want) - set(weights))
    if extra or missing:
        raise ValueError("lora weights do not match the model and target_modules: "
                         + (f"unexpected {', '.join(extra[:3])}" if extra else "")
                         + ("; " if extra and missing else "")
                         + (f"missing {', '.join(missing[:3])}" if missing else ""))
    for k, t in weights.items():
        m = _ADAPTER_KEY.match(k)
        out_f, in_f = shapes[f"layers.{m.group(1)}.{m.group(2)}.weight"]
        shape = (settings.rank, in_f) if m.group(3) == "A" else (out_f, settings.rank)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"lora weight {k} is not a floating-point tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"lora weight {k} has shape {tuple(t.shape)}, expected {shape}")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"lora weight {k} holds NaN or infinite values")
    return settings


def merged(base: dict, entry: dict) -> dict:
    """``base`` with the adapter merged: W + scale * B @ A (peft's merge, computed in fp32 and
    stored in W's dtype) for every adapted weight; the other tensors are shared, not copied."""
    settings = settings_from_entry(entry)
    out = dict(base)
    weights = entry["weights"]
    for k in weights:
        if ".lora_A." not in k:
            continue
        name = k.replace(".lora_A.weight", ".weight")
        a, b = weights[k].float(), weights[k.replace(".lora_A.", ".lora_B.")].float()
        w = base[name]
        out[name] = (w.float() + settings.scale * (b @ a)).to(w.dtype)
    return out
