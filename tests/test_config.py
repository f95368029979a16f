"""Typed configuration: every error class reported at once, precedence, resolved snapshot."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_main
from utils.cli import StageParser
from utils.config import (SECTIONS, Config, ConfigError, PROJECT_ROOT, describe_keys,
                          load_config)


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_config_json_is_valid_and_complete():
    """The shipped config.json loads cleanly and documents every key of every section."""
    cfg = load_config()
    assert cfg.sources == [str(ROOT / "config.json")]
    data = json.loads((ROOT / "config.json").read_text())
    for section, cls in SECTIONS.items():
        assert section in data, f"config.json lacks section {section}"
        missing = {f.name for f in dataclasses.fields(cls)} - set(data[section])
        assert not missing, f"config.json section {section} lacks {sorted(missing)}"
    # Every key has help text somewhere (field metadata) or is self-explanatory dir key.
    assert len(describe_keys()) > 80


def test_all_problems_reported_at_once_with_key_paths_and_hints(tmp_path):
    bad = _write(tmp_path / "bad.json", {
        "training": {"lrr": 0.1, "batch_size": "16", "epochs": 0, "eval_every": 0},
        "modle": {"d_model": 8},
        "dataset": {"source": "finweb", "window": 1.5, "val_split": 2},
        "model": {"tie_embeddings": "yes", "activation": "swiglu2"},
        "paths": "nope",
    })
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    problems = e.value.problems
    text = str(e.value)
    expected = [
        "training.lrr: unknown key (did you mean 'lr'?)",
        'training.batch_size: expected an integer, got "16"',
        "training.epochs: 0 is out of range (must be >= 1)",
        "training.eval_every: 0 is out of range (must be > 0)",
        "modle: unknown section (did you mean 'model'?)",
        "dataset.source: 'finweb' is not one of 'wikipedia', 'fineweb' (did you mean 'fineweb'?)",
        "dataset.window: expected an integer, got 1.5",
        "dataset.val_split: 2 is out of range (must be <= 1)",
        'model.tie_embeddings: expected true/false, got "yes"',
        "model.activation: 'swiglu2' is not one of 'swiglu', 'geglu', 'reglu' (did you mean 'swiglu'?)",
        'paths: expected an object of settings, got "nope"',
    ]
    for exp in expected:
        assert any(p.startswith(exp) for p in problems), f"missing: {exp}\n{text}"
    assert len(problems) == len(expected)
    assert f"{len(expected)} problem(s) in {bad}" in text


def test_invalid_json_names_file_line_and_column(tmp_path):
    bad = _write(tmp_path / "broken.json", '{\n  "training": {\n    "lr": 0.1,\n  }\n}')
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert f"{bad}, line 4 column 3: invalid JSON" in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"model.n_heads": 6, "model.n_kv_heads": 4, "model.d_model": 100,
                               "dataset.window": 8, "dataset.stride": 9})
    text = str(e.value)
    assert "model.n_kv_heads: 4 must divide model.n_heads (6)" in text
    assert "model.d_model: 100 must be divisible by model.n_heads (6)" in text
    assert "dataset.stride: 9 must be <= dataset.window (8)" in text


def test_precedence_defaults_file_other_flags(tmp_path):
    base = _write(tmp_path / "config.json", {"dataset": {"window": 256, "batch": 100},
                                             "training": {"lr": 0.01}})
    other = _write(tmp_path / "other.json", {"dataset": {"window": 128}})
    cfg = load_config(other, overrides={"dataset.batch": 7}, base_file=base)
    assert cfg.training.lr == 0.01            # config.json over defaults
    assert cfg.dataset.window == 128          # --config over config.json
    assert cfg.dataset.batch == 7             # flags over --config
    assert cfg.dataset.seed == 42             # untouched default
    assert cfg.sources == [str(base), str(other), "command-line flags"]

    parser = StageParser("x", "test parser")
    parser.config_flag("--window", key="dataset.window", type=int, help="window")
    parser.config_flag("--lr", key="training.lr", type=float, help="lr")
    args, cfg = parser.parse(["--config", str(other), "--window", "64", "--test"])
    assert cfg.dataset.window == 64 and cfg.test is True
    assert cfg.training.lr == load_config().training.lr  # flag not given: lower layers win
    with pytest.raises(ConfigError) as e:  # flags are validated like file values
        parser.parse(["--window", "1", "--lr", "-1"])
    assert "dataset.window: 1 is out of range" in str(e.value)
    assert "training.lr: -1.0 is out of range (must be > 0)" in str(e.value)


def test_paths_resolve_against_root(tmp_path):
    cfg = load_config(_write(tmp_path / "c.json", {"paths": {"root": str(tmp_path)}}))
    assert cfg.path("paths.cleaned_dir") == tmp_path / "data" / "cleaned_articles"
    assert cfg.shard_dir() == tmp_path / "data/tokenized_datasets/wikipedia_full"
    assert cfg.shard_dir("fineweb", test=True) == tmp_path / "data/tokenized_datasets/fineweb_test"
    assert cfg.resolve("/abs/x") == Path("/abs/x")
    default = load_config()
    assert default.root == PROJECT_ROOT
    assert default.path("paths.checkpoints_dir") == PROJECT_ROOT / "checkpoints"
    assert default.stride == default.dataset.window // 2  # the seed's 50% overlap


def test_resolved_config_snapshot_round_trips(tmp_path):
    cfg = load_config(overrides={"training.lr": 0.005, "dataset.window": 64}, test=True)
    out = cfg.save_resolved(tmp_path / "run")
    data = json.loads(out.read_text())
    assert data["training"]["lr"] == 0.005 and data["_meta"]["test"] is True
    again = load_config(out)  # a snapshot is itself a valid config file
    assert again.to_dict() == cfg.to_dict()


def test_cli_reports_config_errors_with_exit_2(tmp_path):
    bad = _write(tmp_path / "bad.json", {"tokenizer": {"nmae": "x"}, "cleaning": {"workers": -1}})
    proc = run_main("samples", "--config", bad)
    assert proc.returncode == 2
    assert "tokenizer.nmae: unknown key (did you mean 'name'?)" in proc.stderr
    assert "cleaning.workers: -1 is out of range (must be >= 0)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_dataclass_has_every_section():
    assert set(SECTIONS) == {"paths", "tokenizer", "wikipedia", "cleaning", "fineweb", "dataset",
                             "model", "training", "sft", "inference", "benchmark", "logging"}
    assert isinstance(Config().training.lr, float)
