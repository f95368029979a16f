"""Typed configuration: every error class reported at once, precedence, resolved snapshot,
and the isolation of the test suite from the user's config.json."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, assert_resolved_config, offline_env, run_stage, write_config
from utils.cli import StageParser
from utils.config import (BASE_CONFIG_ENV, SECTIONS, Config, ConfigError, PROJECT_ROOT,
                          describe_keys, load_config)


def _write(path: Path, data) -> Path:
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def _problems(path_or_none=None, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path_or_none, **kw)
    return str(e.value)


def _shipped_config_json() -> str:
    """config.json as committed (a user's edits to the working copy are not "shipped");
    the file on disk when this is not a git checkout."""
    try:
        return subprocess.run(["git", "show", "HEAD:config.json"], cwd=ROOT, capture_output=True,
                              text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return (ROOT / "config.json").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- shipped defaults
def test_shipped_config_json_is_exactly_the_defaults(tmp_path):
    """Tests run on the dataclass defaults (LLM_PIPELINE_BASE_CONFIG=none); this keeps them equal
    to the shipped config.json, key for key and value for value."""
    shipped = _write(tmp_path / "config.json", _shipped_config_json())
    data = json.loads(shipped.read_text())
    for section, cls in SECTIONS.items():
        assert section in data, f"config.json lacks section {section}"
        missing = {f.name for f in dataclasses.fields(cls)} - set(data[section])
        assert not missing, (f"config.json as committed lacks {section}.{sorted(missing)}: commit "
                             f"config.json together with the dataclass fields")
    cfg = load_config(shipped, base_file=None)         # validates it (and resolves the preset)
    assert cfg.to_dict() == load_config().to_dict()
    assert {k: v for k, v in data.items() if not k.startswith("_")} == Config().to_dict()


def test_every_key_has_help_text():
    keys = describe_keys()
    assert {k.split(".")[0] for k, _, _ in keys} == set(SECTIONS)
    undocumented = [k for k, help_text, _ in keys if not help_text.strip()]
    assert not undocumented, f"keys without help text: {undocumented}"


def test_suite_ignores_the_users_config_json(tmp_path, monkeypatch):
    """A user's edit (here dataset.auto_prepare: true) reaches a normal run but never a test."""
    edited = _write(tmp_path / "edited.json", {"dataset": {"auto_prepare": True},
                                               "paths": {"samples_dir": str(tmp_path / "mine")}})
    assert load_config().dataset.auto_prepare is False and load_config().sources == []
    monkeypatch.setenv(BASE_CONFIG_ENV, str(edited))      # what config.json is for a user
    assert load_config().dataset.auto_prepare is True
    assert load_config().sources == [str(edited)]
    # Subprocesses inherit the suite's setting: the stage sees the defaults, not the edit.
    listed = run_stage("samples", "--list", env=offline_env(**{BASE_CONFIG_ENV: "none"}))
    assert listed.returncode == 0 and str(ROOT / "data" / "samples") in listed.stdout
    assert str(tmp_path / "mine") not in listed.stdout
    as_user = run_stage("samples", "--list", env=offline_env(**{BASE_CONFIG_ENV: str(edited)}))
    assert as_user.returncode == 0 and str(tmp_path / "mine") in as_user.stdout
    missing = run_stage("samples", "--list", env=offline_env(**{BASE_CONFIG_ENV: str(tmp_path / "no.json")}))
    assert missing.returncode == 2 and "no.json: file not found" in missing.stderr
    assert f"pass an existing file to ${BASE_CONFIG_ENV}" in missing.stderr, missing.stderr   # not --config


# ----------------------------------------------------------------------------- value problems
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


def test_nan_infinity_and_nan_strings_refused_for_numbers(tmp_path):
    bad = _write(tmp_path / "nan.json", '{"training": {"lr": NaN, "min_lr": -Infinity, '
                                        '"weight_decay": 1e400, "beta1": "NaN", "batch_size": -2E+999}}')
    text = _problems(bad)
    assert "5 problem(s)" in text
    assert "training.lr: expected a finite number, got NaN (NaN and Infinity are not allowed)" in text
    assert "training.min_lr: expected a finite number, got -Infinity" in text
    # a number beyond a float's range is quoted as written, not as the Infinity it reads as
    assert "training.weight_decay: expected a finite number, got 1e400 (beyond a float's range)" in text
    assert "training.batch_size: expected an integer, got -2E+999" in text
    assert 'training.beta1: expected a number, got "NaN"' in text
    # Command-line flags are held to the same rule (argparse's float() accepts "nan").
    parser = StageParser("x", "test parser")
    parser.config_flag("--lr", key="training.lr", type=float, help="lr")
    with pytest.raises(ConfigError) as e:
        parser.parse(["--lr", "nan"])
    assert "training.lr: expected a finite number, got NaN" in str(e.value)


def test_integers_are_bounded(tmp_path):
    text = _problems(_write(tmp_path / "big.json", {"training": {"seed": 2 ** 80, "warmup_steps": 2 ** 70},
                                                   "dataset": {"seed": -1}}))
    assert f"training.seed: {2 ** 80} is out of range (must be <= {2 ** 32 - 1})" in text
    assert f"training.warmup_steps: {2 ** 70} is out of range (an integer key must fit 64 bits)" in text
    assert "dataset.seed: -1 is out of range (must be >= 0)" in text
    cfg = load_config(_write(tmp_path / "ok.json", {"training": {"seed": 2 ** 32 - 1}}))
    import numpy as np
    import torch
    np.random.seed(cfg.training.seed)      # the largest allowed seed suits every library
    torch.manual_seed(cfg.training.seed)


def test_duplicated_keys_refused_with_their_lines(tmp_path):
    bad = _write(tmp_path / "dup.json", '{\n  "training": {\n    "lr": 0.001,\n    "epochs": 2,\n'
                                        '    "lr": 30.0\n  },\n  "model": {"dropout": 0.1},\n'
                                        '  "model": {"dropout": 0.2}\n}\n')
    text = _problems(bad)
    assert "training.lr: given 2 times (lines 3, 5)" in text
    assert "model: given 2 times (lines 7, 8)" in text
    # The same key in different objects is not a duplicate.
    cfg = load_config(_write(tmp_path / "ok.json", {"training": {"seed": 1}, "dataset": {"seed": 1}}))
    assert cfg.training.seed == cfg.dataset.seed == 1


def test_list_elements_are_validated(tmp_path):
    text = _problems(_write(tmp_path / "ns.json", {"wikipedia": {"namespaces": [0, "1", 2.5, True, 14]}}))
    assert 'wikipedia.namespaces[1]: expected an integer, got "1"' in text
    assert "wikipedia.namespaces[2]: expected an integer, got 2.5" in text
    assert "wikipedia.namespaces[3]: expected an integer, got true" in text
    assert "14" not in text.replace(str(tmp_path), "")
    text = _problems(_write(tmp_path / "ns2.json", {"wikipedia": {"namespaces": 0}}))
    assert "wikipedia.namespaces: expected a list of integers, got 0" in text
    cfg = load_config(_write(tmp_path / "ok.json", {"wikipedia": {"namespaces": [0, 14.0]}}))
    assert cfg.wikipedia.namespaces == [0, 14] and all(type(n) is int for n in cfg.wikipedia.namespaces)
    # Every list-valued key declares its element type, so no list escapes the check.
    text = _problems(_write(tmp_path / "s.json", {"cleaning": {"drop_sections": ["References", 3]},
                                                  "benchmark": {"tasks": ["lambada", None]}}))
    assert "cleaning.drop_sections[1]: expected a string, got 3" in text
    assert "benchmark.tasks[1]: expected a string, got null" in text
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.type in (list, "list") and not f.metadata.get("internal"):
                raise AssertionError(f"{section}.{f.name}: declare the element type (list[...])")


# ----------------------------------------------------------------------------- unreadable files
def test_invalid_json_names_file_line_and_column(tmp_path):
    bad = _write(tmp_path / "broken.json", '{\n  "training": {\n    "lr": 0.1\n    "epochs": 1\n}\n}')
    assert f"{bad}, line 4 column 5: invalid JSON: Expecting ',' delimiter" in _problems(bad)
    trailing = _write(tmp_path / "trailing.json", '{\n  "training": {\n    "lr": 0.1,\n  }\n}')
    assert f"{trailing}, line 4 column 3: invalid JSON" in _problems(trailing)
    assert "(remove the trailing comma)" in _problems(trailing)
    ctrl = _write(tmp_path / "ctrl.json", '{"training": {"run_name": "a\tb"}}')
    text = _problems(ctrl)
    assert "Invalid control character (write a tab" in text and " at at " not in text


def test_json_too_deep_or_with_a_huge_number_is_a_config_error(tmp_path):
    deep = _write(tmp_path / "deep.json", '{"training": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert f"{deep}: invalid JSON: nested too deeply" in _problems(deep)
    huge = _write(tmp_path / "huge.json", '{"training": {"epochs": 1' + "0" * 5000 + "}}")
    assert f"{huge}: invalid JSON: a number too long to read" in _problems(huge)


def test_not_utf8_is_a_config_error_naming_file_and_line(tmp_path):
    bad = _write(tmp_path / "latin1.json", '{\n  "training": {"run_name": "café"}\n}'.encode("latin-1"))
    assert f"{bad}, line 2: not UTF-8 text (byte 0xe9" in _problems(bad)
    utf16 = _write(tmp_path / "utf16.json", '{"training": {}}'.encode("utf-16"))
    assert f"{utf16}: the file is UTF-16 text; save it as UTF-8" in _problems(utf16)
    bom = _write(tmp_path / "bom.json", '\ufeff{"training": {"lr": 0.01}}'.encode("utf-8"))
    assert load_config(bom).training.lr == 0.01   # a byte-order mark is harmless


@pytest.mark.parametrize("content", ["", "   \n\t\n"])
def test_empty_file_says_empty(tmp_path, content):
    bad = _write(tmp_path / "empty.json", content)
    text = _problems(bad)
    assert f"{bad}: the file is empty" in text and "Expecting value" not in text


@pytest.mark.parametrize("content, line", [
    ('{\n  // the learning rate\n  "training": {"lr": 0.01}\n}', 2),
    ('{\n  "training": {"lr": 0.01}  /* peak */\n}', 2),
    ('{\n  "training": {"lr": 0.01}, # hash\n  "model": {}\n}', 2),
])
def test_comments_get_a_hint(tmp_path, content, line):
    text = _problems(_write(tmp_path / "c.json", content))
    assert f"line {line} column" in text and "JSON has no comments" in text and '"_comment"' in text


def test_yaml_saved_as_json_gets_a_hint(tmp_path):
    for content in ("training:\n  lr: 0.01\n", "---\ntraining:\n  lr: 0.01\n"):
        text = _problems(_write(tmp_path / "c.json", content))
        assert "this looks like YAML; config files are JSON" in text
    text = _problems(_write(tmp_path / "q.json", "{'training': {}}"))
    assert "JSON strings and keys use double quotes" in text


def test_problems_of_every_layer_listed_together(tmp_path):
    base = _write(tmp_path / "base.json", {"training": {"lrr": 1}})
    other = _write(tmp_path / "other.json", '{"training": {"lr": NaN}}')
    with pytest.raises(ConfigError) as e:
        load_config(other, overrides={"dataset.window": 1}, base_file=base)
    text = str(e.value)
    assert f"3 problem(s) in the configuration ({base}, {other}, command-line flags)" in text
    assert f"{base}: training.lrr: unknown key" in text
    assert f"{other}: training.lr: expected a finite number, got NaN" in text
    assert "command-line flags: dataset.window: 1 is out of range" in text
    empty = _write(tmp_path / "empty.json", "")
    with pytest.raises(ConfigError) as e:
        load_config(empty, base_file=base)
    assert f"{base}: training.lrr" in str(e.value) and f"{empty}: the file is empty" in str(e.value)


def test_cross_field_checks_name_the_files_that_set_the_keys(tmp_path):
    model = _write(tmp_path / "model.json", {"model": {"n_heads": 6, "n_kv_heads": 4, "d_model": 96}})
    with pytest.raises(ConfigError) as e:
        load_config(model, overrides={"dataset.window": 8, "dataset.stride": 9})
    text = str(e.value)
    assert "model.n_kv_heads: 4 must divide model.n_heads (6) " \
           f"[model.n_kv_heads, model.n_heads from {model}]" in text
    assert "dataset.stride: 9 must be <= dataset.window (8) " \
           "[dataset.stride, dataset.window from command-line flags]" in text
    lr = _write(tmp_path / "lr.json", {"training": {"min_lr": 0.5}})
    text = _problems(lr)
    assert f"training.min_lr: 0.5 must be <= training.lr (0.002) [training.min_lr from {lr}; " \
           "training.lr from the defaults]" in text


@pytest.mark.parametrize("content, expected", [
    (b"\xff\xfe\x00garbage", "the file is UTF-16 text"),
    (b'{"training": {"lr": 0.001, "lr": 30.0}}', "training.lr: given 2 times (lines 1, 1)"),
    (b'{"training": {"seed": 1208925819614629174706176}}', "training.seed: 1208925819614629174706176 is out of range"),
    (b"\n", "the file is empty"),
    (b'{"training": {"lr": Infinity}}', "training.lr: expected a finite number, got Infinity"),
])
def test_cli_reports_each_config_file_defect_with_exit_2(tmp_path, content, expected):
    bad = _write(tmp_path / "bad.json", content)
    proc = run_stage("samples", "--list", "--config", bad)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "configuration error" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_reports_config_errors_with_exit_2(tmp_path):
    bad = _write(tmp_path / "bad.json", {"tokenizer": {"nmae": "x"}, "cleaning": {"workers": -1}})
    proc = run_stage("samples", "--config", bad)
    assert proc.returncode == 2
    assert "tokenizer.nmae: unknown key (did you mean 'name'?)" in proc.stderr
    assert "cleaning.workers: -1 is out of range (must be >= 0)" in proc.stderr
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- layering, paths
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
    assert cfg.origins["dataset.window"] == str(other) and "dataset.seed" not in cfg.origins

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


def test_stage_resolved_config_reproduces_the_run(tmp_path):
    """A real stage run: its resolved_config.json, loaded as a config, is the run's config
    (config file and flags included); run again with it, the stage gives the same output."""
    raw = tmp_path / "raw"
    raw.mkdir()
    para = "Plain words make a paragraph that is long enough to be kept by the cleaner. " * 3
    (raw / "a.jsonl").write_text(json.dumps({"name": "A", "abstract": para, "sections": [
        {"type": "section", "name": "Body", "has_parts": [{"type": "paragraph", "value": para}]}]}) + "\n")
    cfg = write_config(tmp_path, {"wikipedia": {"raw_dir": str(raw)}, "cleaning": {"min_chars": 10}})
    proc = run_stage("clean", "--config", cfg, "--workers", "1", "--test")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "data" / "cleaned_articles"
    resolved = out / "resolved_config.json"
    assert_resolved_config(resolved, cfg, overrides={"cleaning.workers": 1}, test=True)
    first = (out / "cleaned_a.txt").read_bytes()
    # Break the assertion's premise once: a different flag gives a different config.
    with pytest.raises(AssertionError):
        assert_resolved_config(resolved, cfg, overrides={"cleaning.workers": 2}, test=True)
    again = tmp_path / "again"
    proc = run_stage("clean", "--config", resolved, "--test", "--output-dir", again)
    assert proc.returncode == 0, proc.stderr
    assert (again / "cleaned_a.txt").read_bytes() == first


def test_defaults_dataclass_has_every_section():
    assert set(SECTIONS) == {"paths", "tokenizer", "wikipedia", "cleaning", "fineweb", "dataset",
                             "model", "training", "sft", "dpo", "lora", "rl", "inference",
                             "benchmark", "serve", "logging"}
    assert isinstance(Config().training.lr, float)


# --------------------------------------------------------------------------- blank paths
def _path_like_keys() -> list[str]:
    """Every key marked as a path or as a name that may be a path (hub name or path, folder
    name): the one check in utils/config.py covers exactly these."""
    return [f"{sec}.{f.name}" for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if f.metadata.get("nonblank")]


def test_path_like_keys_are_the_expected_ones():
    keys = set(_path_like_keys())
    assert {"tokenizer.name", "tokenizer.save_dir", "tokenizer.sample_text", "tokenizer.train_name",
            "paths.root", "paths.cleaned_dir", "paths.checkpoints_dir", "wikipedia.raw_dir",
            "cleaning.output_dir", "fineweb.data_dir", "dataset.wikipedia_full_dir",
            "dataset.on_the_fly_source", "sft.dataset", "benchmark.perplexity_source",
            "benchmark.arc_challenge_source"} <= keys
    assert {f"paths.{f.name}" for f in dataclasses.fields(SECTIONS["paths"])} <= keys


@pytest.mark.parametrize("value", ["", "   "], ids=["empty", "spaces"])
def test_blank_path_like_keys_are_refused_naming_each_key(tmp_path, value):
    """An empty (or all-space) tokenizer.name resolved to paths.root, an empty paths.X to the
    root or project root: every path-like key is refused in one go, each named."""
    keys = _path_like_keys()
    data: dict = {}
    for key in keys:
        sec, name = key.split(".")
        data.setdefault(sec, {})[name] = value
    text = _problems(_write(tmp_path / "c.json", data), base_file=None)
    for key in keys:
        assert f"{key}: {json.dumps(value)} is " in text, key
    assert "tokenizer.name" in text and "as a path it would mean paths.root itself" in text
    assert "paths.root" in text and "the project root" in text


def test_cli_a_nul_in_a_path_like_key_is_refused_naming_the_key(tmp_path):
    """A NUL character in a path ("a\\u0000b", legal JSON) was an unexpected error from
    Path.resolve ("embedded null byte"); it is a configuration error naming the key."""
    for section, key in (("paths", "checkpoints_dir"), ("tokenizer", "name")):
        cfg = write_config(tmp_path, {section: {key: "a\u0000b"}})
        r = run_stage("status", "--config", cfg)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"{section}.{key}" in r.stderr and "NUL character" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr


def test_cli_a_symlink_loop_in_a_path_is_refused_naming_the_flag_or_key(tmp_path):
    """A symbolic link loop (a -> b -> a) given as a path flag, as --config, or as a relative
    path-like key was an unexpected error from Path.resolve ("Symlink loop"); it is a usage
    error naming the flag, or a configuration error naming the key (exit 2)."""
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    loop = str(tmp_path / "loop1")
    cfg = write_config(tmp_path, {})
    for args, named in ((["infer", "--config", cfg, "--checkpoint", loop, "--prompt", "x"], "argument --checkpoint"),
                        (["status", "--config", loop], "argument --config"),
                        (["prepare", "--config", cfg, "--input-dir", loop], "argument --input-dir")):
        r = run_stage(*args)
        assert r.returncode == 2, (args, r.stdout + r.stderr)
        assert named in r.stderr and "leads back to itself" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr
    root = tmp_path / "root"
    root.mkdir()
    cfg = write_config(tmp_path, {"paths": {"root": str(root), "checkpoints_dir": "../loop1/x"}})
    r = run_stage("status", "--config", cfg)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "paths.checkpoints_dir" in r.stderr and "leads back to itself" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "unexpected error" not in r.stderr, r.stderr


def test_cli_a_process_substitution_path_is_refused_saying_what_to_do(tmp_path):
    """`--config <(echo ...)` gave "/proc/PID/fd/63: file not found": the stage (a child of
    main.py) cannot read the shell's pipe. A usage error naming the flag and what to do."""
    r = subprocess.run(["bash", "-c", f"{sys.executable} {ROOT / 'main.py'} status --config <(echo '{{}}')"],
                       capture_output=True, text=True, env=offline_env(), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "argument --config" in r.stderr and "process substitution" in r.stderr, r.stderr
    assert "Write it to a file" in r.stderr and "Traceback" not in r.stderr


def test_cli_blank_tokenizer_name_and_path_flags_are_refused(tmp_path):
    """Through the CLI: tokenizer.name "" (or spaces, also given as --name) is a configuration
    error naming tokenizer.name (exit 2); an empty path flag (--output-dir "", --save-dir "",
    --config "") or --resume "" is a usage error naming the flag, before anything is written
    (they meant the current folder, or for --resume, no resume at all)."""
    here = tmp_path / "cwd"
    here.mkdir()
    for value in ("", "   "):
        cfg = write_config(tmp_path, {"tokenizer": {"name": value}})
        for args in (["tokenize", "--config", cfg, "--encode", "x"], ["prepare", "--config", cfg]):
            r = run_stage(*args, cwd=here)
            assert r.returncode == 2, (args, r.stdout + r.stderr)
            assert "tokenizer.name" in r.stderr and "Traceback" not in r.stderr, r.stderr
    cfg = write_config(tmp_path, {})
    r = run_stage("tokenize", "--config", cfg, "--name", "  ", "--encode", "x", cwd=here)
    assert r.returncode == 2 and "command-line flags" in r.stderr and "tokenizer.name" in r.stderr, r.stderr
    for args, flag in ((["prepare", "--config", cfg, "--output-dir", ""], "--output-dir"),
                       (["tokenize", "--config", cfg, "--save-dir", " "], "--save-dir"),
                       (["clean", "--config", ""], "--config"),
                       (["train", "--config", cfg, "--resume", ""], "--resume"),
                       (["sft", "train", "--config", cfg, "--resume", ""], "--resume")):
        r = run_stage(*args, cwd=here)
        assert r.returncode == 2, (args, r.stdout + r.stderr)
        assert f"argument {flag}: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert list(here.iterdir()) == []
