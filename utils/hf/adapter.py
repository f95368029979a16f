"""LoRA adapters as PEFT folders: adapter_config.json + adapter_model.safetensors, under the
module names of our Hugging Face export (library; no side effects; peft is imported where a
folder is written).

    write_adapter(folder, entry, base_name)   an adapter entry (utils/lora.py) into ``folder``
    save_adapter(dest, entry, base_name)      the same, written aside and renamed into place
    read_adapter(folder)                      a PEFT LoRA folder -> an entry under our names

Contract: ``peft.PeftModel.from_pretrained(LlamaForCausalLM of our HF export of the base,
folder)`` computes what our model with the adapter computes (tests/test_lora.py). Tensor keys
are PEFT's on-disk ones, ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``;
the config is peft's own ``LoraConfig.save_pretrained``. Reading takes what a merge here
honours (LoRA on the seven projections of every layer, scale alpha / r or rsLoRA's alpha /
sqrt(r)) and refuses the rest naming the field (DoRA, trained biases, modules_to_save,
per-layer rank or alpha patterns, layers_to_transform, fan_in_fan_out) or the file (a pickled
adapter_model.bin is not read: untrusted bytes are data). Shapes are checked against the
model by utils.lora.check_entry where the adapter is merged.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from utils.cli import PipelineError
from utils.hf.mapping import hf_weight_name, our_weight_name
from utils.lora import TARGETS, settings_from_entry

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_REFUSED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained extra modules)",
            "rank_pattern": "per-layer ranks (rank_pattern)", "alpha_pattern": "per-layer alphas (alpha_pattern)",
            "layers_to_transform": "layers_to_transform (an adapter on some layers only)",
            "fan_in_fan_out": "fan_in_fan_out (transposed weights)"}


def peft_key(ours: str) -> str:
    """``layers.0.attn.wq.lora_A.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    module, ab = ours.rsplit(".lora_", 1)
    return PREFIX + hf_weight_name(module + ".weight").removesuffix(".weight") + ".lora_" + ab


def our_key(key: str) -> str:
    """The inverse of :func:`peft_key` (an adapter name PEFT may leave in, ``.default``, dropped)."""
    module, ab = key.removeprefix(PREFIX).rsplit(".lora_", 1)
    ab = ab.replace(".default.", ".")
    return our_weight_name(module + ".weight").removesuffix(".weight") + ".lora_" + ab


def write_adapter(folder: Path, entry: dict, base_name: str) -> list[Path]:
    """adapter_config.json (peft's LoraConfig, task CAUSAL_LM) and adapter_model.safetensors."""
    # peft imports transformers (about 4 s): only what writes an adapter folder pays it
    from peft import LoraConfig
    settings = settings_from_entry(entry)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), use_rslora=settings.rslora,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_name)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    tensors = {peft_key(k): v.detach().to("cpu").contiguous() for k, v in sorted(entry["weights"].items())}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return [folder / CONFIG_FILE, folder / WEIGHTS_FILE]


def save_adapter(dest: Path, entry: dict, base_name: str) -> list[Path]:
    """:func:`write_adapter` into a temporary sibling renamed to ``dest`` when complete (an
    earlier ``dest`` is replaced only then)."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    try:
        write_adapter(tmp, entry, base_name)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return [dest / CONFIG_FILE, dest / WEIGHTS_FILE]


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PipelineError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PipelineError(f"{path}: cannot be read as JSON ({e}).") from None
    if not isinstance(config, dict):
        raise PipelineError(f"{path}: not a JSON object.")
    if config.get("peft_type") != "LORA":
        raise PipelineError(f"{path}: peft_type is {config.get('peft_type')!r}; only LoRA adapters "
                            "(peft_type 'LORA') merge here.")
    for field, what in _REFUSED.items():
        if config.get(field):
            raise PipelineError(f"{path}: {field} is set: {what} cannot be merged here; merge it with "
                                "peft (PeftModel.merge_and_unload) instead.")
    if config.get("bias", "none") != "none":
        raise PipelineError(f"{path}: bias is {config.get('bias')!r}: adapters that train biases cannot "
                            "be merged into a bias-free Llama; only bias 'none'.")
    return config


def _read_weights(folder: Path) -> dict:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        pickled = " (adapter_model.bin, a pickle, is not read: save it with safe_serialization)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise PipelineError(f"{folder}: no {WEIGHTS_FILE}{pickled}.")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise PipelineError(f"{path}: cannot be read as safetensors ({e}).") from None


def read_adapter(folder) -> dict:
    """A PEFT LoRA folder as an adapter entry of utils/lora.py (names ours); PipelineError
    naming the file and field it cannot take."""
    folder = Path(folder)
    config, tensors = _read_config(folder), _read_weights(folder)
    weights, targets = {}, set()
    for key, t in tensors.items():
        try:
            name = our_key(key)
        except (KeyError, ValueError):
            raise PipelineError(f"{folder / WEIGHTS_FILE}: tensor {key!r} is not a LoRA weight of a "
                                f"Llama projection ({', '.join(TARGETS)}).") from None
        weights[name] = t
        targets.add(next(hf for hf, path in TARGETS.items() if f".{path}.lora_" in name))
    entry = {"rank": config.get("r"), "alpha": config.get("lora_alpha"),
             "dropout": config.get("lora_dropout") or 0.0, "target_modules": sorted(targets),
             "rslora": bool(config.get("use_rslora")), "weights": weights}
    try:
        settings_from_entry(entry)
    except ValueError as e:
        raise PipelineError(f"{folder / CONFIG_FILE}: {e}.") from None
    return entry
