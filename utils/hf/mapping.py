"""Our model <-> transformers' ``LlamaForCausalLM``: state-dict renames and config translation
both ways (library; no side effects; transformers is imported only by :func:`hf_config`).

Contract: model.py's layouts are Llama's (fused nothing, rotate-half RoPE, the same weight
shapes), so the mapping is a pure rename (tensors shared, not copied):

- ``to_hf_state_dict(model_or_state_dict, args=None)`` -> LlamaForCausalLM's names; with tied
  embeddings ``lm_head.weight`` is the embedding tensor, as HF's own state_dict has it.
- ``from_hf_state_dict(sd, args)`` -> ours (``rotary_emb.inv_freq`` buffers dropped).
- ``hf_weight_name(name)`` / ``our_weight_name(name)``: one name either way (LoRA adapters).
- ``hf_config(args, eos_id=None)`` -> ``transformers.LlamaConfig``;
  ``model_args_from_hf_config(config, bos_id=None)`` -> ``ModelArgs``.
- What Llama cannot express (LayerNorm) raises ValueError naming it; an unknown tensor name
  raises KeyError naming it. tests/test_model.py checks logits parity both ways.
- ``llama_problems(args)``: what of a model Llama cannot express, each naming the option (empty:
  the HF and GGUF writers take it); ``notes(args)``: what changes meaning on export.
"""
from __future__ import annotations

import re
from typing import Optional

import torch.nn as nn

from model import ModelArgs
from utils.activations import HF_ACT_NAMES

_HF_NAMES = [  # (ours, Hugging Face LlamaForCausalLM); {i} is the layer index
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attn.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attn.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attn.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attn.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.mlp.w_gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.mlp.w_up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.mlp.w_down.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


def rename(sd: dict, pairs: list[tuple[str, str]]) -> dict:
    """``sd`` with each key renamed by the first of ``pairs`` (source, target; ``{i}`` a
    block index) that matches; KeyError naming the keys none matches."""
    pats = [(re.compile("^" + re.escape(a).replace(r"\{i\}", r"(\d+)") + "$"), b) for a, b in pairs]
    out, unknown = {}, []
    for k, v in sd.items():
        for pat, target in pats:
            m = pat.match(k)
            if m:
                out[target.replace("{i}", m.group(1)) if m.groups() else target] = v
                break
        else:
            unknown.append(k)
    if unknown:
        raise KeyError(f"no Llama counterpart for: {', '.join(unknown[:5])}")
    return out


def hf_weight_name(ours: str) -> str:
    """One weight's Hugging Face name (``layers.0.attn.wq.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight``); KeyError when it has none."""
    return next(iter(rename({ours: None}, _HF_NAMES)))


def our_weight_name(hf: str) -> str:
    """The inverse of :func:`hf_weight_name`."""
    return next(iter(rename({hf: None}, [(b, a) for a, b in _HF_NAMES])))


def _check_hf_compatible(args: ModelArgs) -> None:
    if args.norm != "rmsnorm":
        raise ValueError("LlamaForCausalLM has no LayerNorm: only norm 'rmsnorm' models convert")
    if args.attention != "standard":
        raise ValueError("LlamaForCausalLM has no Infini-attention (segments, compressive memory, "
                         "gates): only attention 'standard' models convert")


def to_hf_state_dict(model: nn.Module | dict, args: Optional[ModelArgs] = None) -> dict:
    """Our state dict renamed to LlamaForCausalLM's (tensors shared, not copied). With tied
    embeddings ``lm_head.weight`` is the embedding tensor, as HF's own state_dict has it."""
    if isinstance(model, nn.Module):
        args, sd = model.args, model.state_dict()
    else:
        sd = model
    if args is not None:
        _check_hf_compatible(args)
    sd = {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in sd.items()}
    out = rename(sd, _HF_NAMES)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict, args: ModelArgs) -> dict:
    """A LlamaForCausalLM state dict renamed to ours (load with ``model.load_state_dict``).
    ``lm_head.weight`` may be absent when ``args.tie_embeddings``."""
    _check_hf_compatible(args)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    out = rename(sd, [(b, a) for a, b in _HF_NAMES])
    if args.tie_embeddings:
        out["lm_head.weight"] = out["tok_embeddings.weight"]
    elif "lm_head.weight" not in out:
        raise KeyError("lm_head.weight missing but the model has untied embeddings")
    return out


# ModelArgs field -> LlamaConfig attribute: the one table both directions use. The fields it
# leaves out are translated by hand below (SPECIAL_FIELDS); tests/test_model.py checks that
# together they cover every ModelArgs field, so a new field cannot be forgotten here.
HF_CONFIG_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
    "ffn_hidden": "intermediate_size", "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "dropout": "attention_dropout", "init_std": "initializer_range", "bos_id": "bos_token_id",
}
SPECIAL_FIELDS = {
    "activation": "hidden_act, through HF_ACT_NAMES",
    "rope_theta": "rope_parameters['rope_theta'] (rope_type 'default')",
    "norm": "rmsnorm only (LayerNorm is refused)",
    "document_mask": "a training-time attention mask: not part of the architecture; never set on import",
    "attention": "standard only (Infini-attention is refused)",
    "segment_length": "Infini-attention only (refused)",
    "infini_gate": "Infini-attention only (refused)",
    "infini_delta_rule": "Infini-attention only (refused)",
}


def hf_config(args: ModelArgs, eos_id: Optional[int] = None):
    """The ``transformers.LlamaConfig`` of the same architecture."""
    _check_hf_compatible(args)
    # transformers' Llama package (~2 s more than a tokenizer needs) sets TORCHINDUCTOR_CACHE_DIR
    # in the environment when imported (no library module may at import), and the GGUF writer
    # renames weights through this module without it
    from transformers import LlamaConfig
    return LlamaConfig(
        **{hf: getattr(args, ours) for ours, hf in HF_CONFIG_NAMES.items()},
        head_dim=args.head_dim, hidden_act=HF_ACT_NAMES[args.activation],
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        attention_bias=False, mlp_bias=False, eos_token_id=eos_id)


def model_args_from_hf_config(c, bos_id: Optional[int] = None) -> ModelArgs:
    """ModelArgs of a LlamaConfig (for importing a Hugging Face Llama)."""
    act = {v: k for k, v in HF_ACT_NAMES.items()}.get(c.hidden_act)
    if act is None:
        raise ValueError(f"hidden_act {c.hidden_act!r} has no gated-MLP counterpart here")
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", 10_000.0))
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ValueError(f"rope_theta {theta!r} is not a number")
    values = {ours: getattr(c, hf) for ours, hf in HF_CONFIG_NAMES.items()}
    values["n_kv_heads"] = values["n_kv_heads"] or c.num_attention_heads
    values["tie_embeddings"] = bool(values["tie_embeddings"])
    values["dropout"] = float(values["dropout"] or 0.0)
    if bos_id is not None:
        values["bos_id"] = bos_id
    return ModelArgs(**values, activation=act, norm="rmsnorm", rope_theta=float(theta))


def llama_problems(args) -> list[str]:
    """What of ``args`` LlamaForCausalLM cannot express (empty: exportable), each naming the
    option and why."""
    out = []
    if args.norm != "rmsnorm":
        out.append(f"model.norm is '{args.norm}': Llama has RMSNorm only (train with "
                   "model.norm 'rmsnorm' to export)")
    if getattr(args, "attention", "standard") != "standard":
        out.append(f"model.attention is '{args.attention}': Llama (and llama.cpp's llama "
                   "architecture) has no compressive memory nor its gates, and attends over the "
                   "whole input rather than within segments, so no Llama model computes what this "
                   "one does (use it with infer, benchmark and serve here)")
    return out


def notes(args) -> list[str]:
    """What changes meaning on export, said in the model card and by the stage."""
    out = []
    if args.document_mask:
        out.append("trained with document masks (attention kept inside each document of a "
                   "packed window); a Llama model attends over the whole input, which is the "
                   "same for one document per input")
    if args.dropout:
        out.append(f"trained with dropout {args.dropout}: inference runs without it, as here")
    return out
