"""Hostile and malformed inputs through the data stages (`clean`, `prepare`, `fineweb`), run
the way a user runs them (`python main.py STAGE --config ...`), checking real outputs.

Classes covered (issue 9, docs/data_stages.md):

- clean: a bad record (lone surrogate, nesting deep enough for RecursionError, invalid JSON
  or UTF-8, a missing required key) costs only itself, counted with ``file:line`` and reason,
  with 1 and 2 worker processes; non-files among the inputs are reported by name; sections
  titled like a bibliography are dropped by words and their titles reported; a re-run that
  keeps nothing leaves the earlier output byte-identical; a bug in our own conversion fails
  the file naming the page instead of being counted as bad input.
- fineweb: NaN or null ``language_score`` fails the filter and is counted; parquet inputs
  that are not parquet, empty, truncated, of the wrong column types or without rows end in
  exit 1 naming the file, no traceback, and an earlier shard set is left byte-identical even
  with ``--force``.
- prepare: ``--force`` over a bad input and an unreadable ``metadata.json`` never delete or
  change the existing shard set.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import SPM_MODEL, offline_env, run_main, run_stage
from tests.test_prep import saved_tokenizer  # noqa: F401 (fixture)

PARA = "is described here in one long paragraph of ordinary text, long enough to be kept."


def article(name: str, extra_sections: list | None = None) -> dict:
    return {"name": name, "sections": [
        {"type": "section", "name": "Abstract",
         "has_parts": [{"type": "paragraph", "value": f"{name} {PARA}"}]},
        *(extra_sections or [])]}


def section(title: str, text: str) -> dict:
    return {"type": "section", "name": title, "has_parts": [{"type": "paragraph", "value": text}]}


def snapshot(d: Path) -> dict[str, str]:
    """Every file under d (hidden ones included) -> sha256."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def assert_clean_exit(p, code: int) -> None:
    assert p.returncode == code, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout


# --------------------------------------------------------------------------- clean
def hostile_jsonl(path: Path) -> list[str]:
    """A JSONL dump mixing good articles with every class of bad record; returns the names of
    the articles that must be kept, in order."""
    deep_parts = '[{"type":"x","has_parts":' * 3000 + "[]" + "}]" * 3000
    lines = [
        json.dumps(article("Alpha", [section("Selected bibliography", "ISBN 978-0-00-000000-1"),
                                     section("Etymological bibliography", "ISBN 978-0-00-000000-2"),
                                     section("History", "Alpha history is kept.")])),
        '{"name": "Surrogate", "sections": [{"type": "paragraph", "value": '
        '"Surrogate \\ud800 ' + PARA + '"}]}',                                   # 2: repaired
        "[" * 100_000 + "]" * 100_000,                                           # 3: RecursionError
        json.dumps(article("Beta", [section("Reference literature", "ISBN 978-0-00-000000-3")])),
        json.dumps({"sections": article("x")["sections"]}),                      # 5: no name
        json.dumps({"name": "No sections"}),                                     # 6: no sections
        '{"name": "Deep", "sections": ' + deep_parts + "}",                      # 7: too deep
        '{"name": "Broken", "sections": [',                                      # 8: invalid JSON
        b'{"name": "Bad \xff bytes", "sections": []}'.decode("latin-1"),         # 9: not UTF-8
        json.dumps(article("Gamma\u0007Control")),                               # 10: repaired
        json.dumps(article("Delta")),
        '{"name": "Huge", "sections": [], "id": 1' + "0" * 5000 + "}",           # 12: 5,001 digits
    ]
    path.write_bytes("\n".join(lines).encode("utf-8").replace("\u00ff".encode(), b"\xff") + b"\n")
    return ["Alpha", "Surrogate", "Beta", "GammaControl", "Delta"]


@pytest.mark.parametrize("workers", [1, 2])
def test_clean_bad_records_cost_only_themselves(tmp_config, tmp_path, workers):
    inp = tmp_path / "in"
    inp.mkdir()
    kept = hostile_jsonl(inp / "dump.jsonl")
    (inp / "folder.jsonl").mkdir()
    (inp / "dangling.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    out = tmp_path / "out"
    p = run_stage("clean", "--config", tmp_config({"cleaning": {"min_chars": 20}}),
                 "--input-dir", inp, "--output-dir", out, "--workers", workers)
    assert_clean_exit(p, 0)
    lines = (out / "cleaned_dump.txt").read_text(encoding="utf-8").splitlines()
    assert [ln.split(" ")[0] for ln in lines] == kept
    assert "\ufffd" in lines[1] and "\ud800" not in lines[1] and "\x07" not in lines[3]
    text = "\n".join(lines)
    assert "ISBN" not in text and "Alpha history is kept." in text

    summary = json.loads((out / "cleaning_summary.json").read_text())
    f = summary["files"][0]
    assert f["read"] == 12 and f["kept"] == 5 and f["skipped"] == {"malformed": 7}
    assert f["malformed"]["missing required key 'name'"] == 1
    assert f["malformed"]["missing required key 'sections'"] == 1
    assert sum(f["malformed"].values()) == 7
    assert set(f["repaired"]) == {"lone surrogate replaced", "control characters removed"} or \
        sum(f["repaired"].values()) == 2, f["repaired"]
    assert f["malformed"]["invalid JSON"] == 4, f["malformed"]     # lines 3, 7, 8 and 12
    for loc in ("dump.jsonl:3", "dump.jsonl:5", "dump.jsonl:6"):
        assert loc in p.stdout
    assert "dump.jsonl:5: missing required key 'name'" in p.stdout
    assert summary["totals"]["sections_dropped"] == {"Selected bibliography": 1,
                                                     "Etymological bibliography": 1,
                                                     "Reference literature": 1}
    assert "Reference literature 1" in p.stdout
    skipped = {s["name"]: s["reason"] for s in summary["inputs_skipped"]}
    assert set(skipped) == {"folder.jsonl", "dangling.jsonl"}
    assert "folder.jsonl" in p.stdout and "dangling.jsonl" in p.stdout and "symbolic link" in p.stdout


def test_clean_rerun_keeping_nothing_leaves_earlier_output(tmp_config, tmp_path):
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    dump = inp / "dump.jsonl"
    dump.write_text(json.dumps(article("Alpha")) + "\n", encoding="utf-8")
    cfg = tmp_config({"cleaning": {"min_chars": 20}})
    assert_clean_exit(run_stage("clean", "--config", cfg, "--input-dir", inp, "--output-dir", out), 0)
    before = snapshot(out)
    dump.write_text(json.dumps({"name": "Empty", "sections": []}) + "\n" + "{not json\n",
                    encoding="utf-8")
    p = run_stage("clean", "--config", cfg, "--input-dir", inp, "--output-dir", out, "--force")
    assert_clean_exit(p, 1)
    assert "no usable article" in p.stderr and "unchanged" in p.stderr
    after = snapshot(out)
    assert after["cleaned_dump.txt"] == before["cleaned_dump.txt"]
    assert not [n for n in after if ".tmp-" in n]


def test_clean_bug_in_our_conversion_is_not_bad_input(tmp_config, tmp_path):
    """A conversion that raises (injected through sitecustomize) fails the file naming the
    page, exit 1, instead of being counted as a malformed page."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import utils.data.wikitext as wt\n"
        "_orig = wt.ArticleBuilder.add_text\n"
        "def add_text(self, text, *a, **k):\n"
        "    if 'TRIGGER-BUG' in text:\n"
        "        raise KeyError('simulated bug')\n"
        "    return _orig(self, text, *a, **k)\n"
        "wt.ArticleBuilder.add_text = add_text\n")
    inp, out = tmp_path / "in", tmp_path / "out"
    inp.mkdir()
    (inp / "dump.xml").write_text(
        "<mediawiki><page><title>Fine</title><ns>0</ns><revision><text>Fine page text that "
        "is long enough to keep.</text></revision></page><page><title>Buggy page</title><ns>0</ns>"
        "<revision><text>TRIGGER-BUG text</text></revision></page></mediawiki>", encoding="utf-8")
    from tests.conftest import ROOT
    env = offline_env(PYTHONPATH=f"{hook}:{ROOT}")
    p = run_main("clean", "--config", tmp_config({"cleaning": {"min_chars": 5}}), "--input-dir", inp,
                 "--output-dir", out, env=env)
    assert_clean_exit(p, 1)
    assert "Buggy page" in p.stderr and "bug" in p.stderr and "KeyError" in p.stderr
    f = json.loads((out / "cleaning_summary.json").read_text())["files"][0]
    assert f["status"] == "failed" and not f["malformed"] and "simulated bug" in f["traceback"]
    assert not (out / "cleaned_dump.txt").exists()


def test_clean_output_dir_that_cannot_be_created(tmp_config, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    (inp / "dump.jsonl").write_text(json.dumps(article("Alpha")) + "\n", encoding="utf-8")
    (tmp_path / "a_file").write_text("x")
    p = run_stage("clean", "--config", tmp_config(), "--input-dir", inp,
                 "--output-dir", tmp_path / "a_file" / "sub")
    assert_clean_exit(p, 1)
    assert "a_file" in p.stderr and "--output-dir" in p.stderr


# --------------------------------------------------------------------------- fineweb
TEXT = ("The committee met on Tuesday to discuss the new bridge over the river, and after a "
        "long debate the members agreed to publish the full report next month. ")


@pytest.fixture(scope="module")
def fw_env(tmp_path_factory, saved_tokenizer):  # noqa: F811
    """A good parquet folder, a config and a complete fineweb shard set built from it once."""
    from tests.conftest import write_config
    root = tmp_path_factory.mktemp("fw_hostile")
    good = root / "good"
    good.mkdir()
    n = 12
    pq.write_table(pa.table({
        "text": [f"Document {i}. " + TEXT * 3 for i in range(n)],
        "language_score": [0.9, float("nan"), None, 0.5] * (n // 4)}), good / "part.parquet")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL), "save_dir": str(saved_tokenizer)},
                              "fineweb": {"min_tokens": 5, "workers": 1, "min_language_score": 0.65},
                              "dataset": {"shard_tokens": 200, "window": 32}})
    ref = root / "ref"
    p = run_stage("fineweb", "--config", cfg, "--data-dir", good, "--output-dir", ref, "--no-progress")
    assert_clean_exit(p, 0)
    return {"root": root, "cfg": cfg, "good": good, "ref": ref, "n": n}


def test_fineweb_nan_and_null_scores_fail_the_filter(fw_env):
    meta = json.loads((fw_env["ref"] / "metadata.json").read_text())
    n = fw_env["n"]
    assert meta["stats"]["documents_read"] == n
    assert meta["stats"]["dropped_by_reason"] == {"language_score_missing": n // 2,
                                                  "language_score": n // 4}
    assert meta["totals"]["documents"] == n // 4


def _write_bad(kind: str, d: Path) -> Path:
    f = d / "part.parquet"
    text = [TEXT] * 40
    if kind == "data_dir_typo":
        return d / "sampel"
    if kind == "not_parquet":
        f.write_text("id,text\n1,hello\n")
    elif kind == "empty_file":
        f.write_bytes(b"")
    elif kind == "truncated":
        pq.write_table(pa.table({"text": text, "language_score": [0.9] * 40}), f)
        f.write_bytes(f.read_bytes()[:-40])
    elif kind == "score_as_strings":
        pq.write_table(pa.table({"text": text, "language_score": ["0.9"] * 40}), f)
    elif kind == "text_as_binary":
        pq.write_table(pa.table({"text": pa.array([b"\xff\xfe bad"] * 40, pa.binary()),
                                 "language_score": [0.9] * 40}), f)
    elif kind == "no_rows":
        pq.write_table(pa.table({"text": pa.array([], pa.string()),
                                 "language_score": pa.array([], pa.float64())}), f)
    elif kind == "missing_column":
        pq.write_table(pa.table({"text": text}), f)
    elif kind == "damaged_row_group":
        pq.write_table(pa.table({"text": [TEXT * 3 + str(i) for i in range(400)],
                                 "language_score": [0.9] * 400}), f, row_group_size=100,
                       compression="none")
        b = bytearray(f.read_bytes())
        b[len(b) * 3 // 5: len(b) * 3 // 5 + 4000] = b"\xff" * 4000
        f.write_bytes(bytes(b))
    return f


@pytest.mark.parametrize("kind", ["data_dir_typo", "not_parquet", "empty_file", "truncated", "score_as_strings",
                                  "text_as_binary", "no_rows", "missing_column",
                                  "damaged_row_group"])
def test_fineweb_bad_parquet_is_a_clear_error_and_keeps_the_old_set(fw_env, tmp_path, kind):
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = _write_bad(kind, bad_dir)
    out = tmp_path / "set"
    shutil.copytree(fw_env["ref"], out)
    before = snapshot(out)
    data_dir = bad if kind == "data_dir_typo" else bad_dir
    p = run_stage("fineweb", "--config", fw_env["cfg"], "--data-dir", data_dir, "--output-dir", out,
                 "--no-progress", "--force")
    assert_clean_exit(p, 1)
    assert str(bad) in p.stderr and "unexpected" not in p.stderr
    assert snapshot(out) == before                   # and no side folder (.rebuild) is left
    assert not (out / ".rebuild").exists()


def test_fineweb_force_replaces_the_set_only_when_complete(fw_env, tmp_path):
    out = tmp_path / "set"
    shutil.copytree(fw_env["ref"], out)
    p = run_stage("fineweb", "--config", fw_env["cfg"], "--data-dir", fw_env["good"], "--output-dir",
                 out, "--no-progress", "--force", "--shard-tokens", "400")
    assert_clean_exit(p, 0)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["shard_tokens"] == 400 and not (out / ".rebuild").exists()
    assert sorted(p.name for p in out.glob("tokens_*.npy")) == [s["file"] for s in meta["shards"]]
    p = run_stage("fineweb", "--config", fw_env["cfg"], "--data-dir", fw_env["good"], "--output-dir",
                 out, "--no-progress", "--shard-tokens", "400")
    assert_clean_exit(p, 0)
    assert "up to date" in p.stdout


# --------------------------------------------------------------------------- prepare
@pytest.fixture(scope="module")
def prep_ref(tmp_path_factory, saved_tokenizer):  # noqa: F811
    """Cleaned articles and a complete prepare shard set built from them once."""
    root = tmp_path_factory.mktemp("prep_hostile")
    cleaned = root / "cleaned"
    cleaned.mkdir()
    (cleaned / "cleaned_a.txt").write_text("".join(f"Article {i}. {TEXT}\n" for i in range(20)),
                                           encoding="utf-8")
    ref = root / "ref"
    cfg = _prep_config(root, cleaned, saved_tokenizer)
    assert_clean_exit(run_stage("prepare", "--config", cfg, "--output-dir", ref, "--no-progress"), 0)
    return cleaned, ref


def _prep_config(root: Path, cleaned: Path, saved_tok: Path) -> Path:
    from tests.conftest import write_config
    return write_config(root, {"tokenizer": {"name": str(SPM_MODEL), "save_dir": str(saved_tok)},
                               "paths": {"cleaned_dir": str(cleaned)},
                               "dataset": {"shard_tokens": 300, "window": 32, "workers": 1}})


@pytest.fixture
def prep_set(prep_ref, tmp_path, saved_tokenizer):  # noqa: F811
    """A private copy of the reference set and its inputs: (cleaned dir, config, set dir)."""
    cleaned, out = tmp_path / "cleaned", tmp_path / "set"
    shutil.copytree(prep_ref[0], cleaned)
    shutil.copytree(prep_ref[1], out)
    return cleaned, _prep_config(tmp_path, cleaned, saved_tokenizer), out


def test_prepare_force_with_a_bad_input_keeps_the_old_set(prep_set):
    cleaned, cfg, out = prep_set
    before = snapshot(out)
    (cleaned / "cleaned_b.txt").write_bytes(b"fine line\n\xff\xfe not utf-8\n")
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--no-progress", "--force")
    assert_clean_exit(p, 1)
    assert f"{cleaned / 'cleaned_b.txt'}:2" in p.stderr
    assert snapshot(out) == before and not (out / ".rebuild").exists()
    # a typo in the input folder: refused before anything is touched
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--no-progress", "--force",
                 "--input-dir", cleaned.parent / "cleand")
    assert_clean_exit(p, 1)
    assert snapshot(out) == before and not (out / ".rebuild").exists()


@pytest.mark.parametrize("failure", ["bad_line_after_shards", "tokenizer_without_bos"])
def test_failed_prepare_force_removes_its_side_folder(prep_set, saved_tokenizer, tmp_path,  # noqa: F811
                                                      failure):
    """A --force run that fails after building part of the new set beside the old one (a
    damaged line after several shards were written into .rebuild/, or a tokenizer the engine
    refuses once it has started) exits 1 naming the problem; the old set is byte-identical and
    no .rebuild/ folder, empty or holding shards, is left beside it."""
    cleaned, cfg, out = prep_set
    before = snapshot(out)
    args = ["--no-progress", "--force"]
    if failure == "bad_line_after_shards":
        good = "".join(f"More {i}. {TEXT}\n" for i in range(20))
        (cleaned / "cleaned_b.txt").write_bytes(good.encode() + b"\xff\xfe not utf-8\n")
        args += ["--batch", "2"]        # small chunks: shards are written before the bad line
        expect = f"{cleaned / 'cleaned_b.txt'}:21"
    else:
        tok = tmp_path / "nobos"
        shutil.copytree(saved_tokenizer, tok)
        conf = json.loads((tok / "tokenizer_config.json").read_text())
        conf["bos_token"] = None
        (tok / "tokenizer_config.json").write_text(json.dumps(conf))
        (tmp_path / "c2").mkdir()
        cfg = _prep_config(tmp_path / "c2", cleaned, tok)
        expect = "no BOS or EOS token"
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, *args)
    assert_clean_exit(p, 1)
    assert expect in p.stderr
    assert snapshot(out) == before
    assert not (out / ".rebuild").exists(), sorted(p.name for p in (out / ".rebuild").iterdir())


@pytest.mark.parametrize("damage", ["garbage", "a_directory", "deleted"])
def test_prepare_unreadable_metadata_never_deletes(prep_set, damage):
    cleaned, cfg, out = prep_set
    meta = out / "metadata.json"
    if damage == "garbage":
        meta.write_text('{"complete": tr')
    else:
        meta.unlink()
        if damage == "a_directory":
            meta.mkdir()
    before = snapshot(out)
    assert len([k for k in before if k.startswith("tokens_")]) > 1
    p = run_stage("prepare", "--config", cfg, "--output-dir", out, "--no-progress")
    assert_clean_exit(p, 1)
    assert str(out) in p.stderr and "nothing" in p.stderr and "--force" in p.stderr
    assert snapshot(out) == before
