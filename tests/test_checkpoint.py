"""utils/training/checkpoint.py: the one loader refuses every bad file with a CheckpointError that names
the file (exit 1), never runs pickled code, rebuilds the model from the file alone, and lists
runs (newest first, legacy flat layout included); a training start that fails leaves its run
places as they were (utils.run.RunOutputs).

Checkpoints here are written by the real writer (save_checkpoint) with a tiny real model;
bad files are made from them (truncated copies, flipped entries) or from scratch (random
bytes, a Git LFS pointer, a pickle whose __reduce__ would run a command).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import model as model_lib
from utils.run import find_run, list_runs, load_checkpoint, load_model
from utils.training.checkpoint import FORMAT_VERSION, CheckpointError, save_checkpoint
from utils.cli import EXIT_FAILURE

ARGS = model_lib.ModelArgs.from_dict(dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4,
                                          n_kv_heads=2, ffn_hidden=64, max_seq_len=32))


def payload(model=None, **extra) -> dict:
    torch.manual_seed(0)
    m = model or model_lib.create_model(ARGS)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return {"kind": "pretrain", "model": m.state_dict(), "model_args": ARGS.to_dict(),
            "optimizer": {"adamw": opt.state_dict()}, "scheduler": {"step": 3}, "step": 3,
            "epoch": 0, "tokens_seen": 96, "data_position": {"epoch": 0, "index": 6},
            "rng": {"world_size": 1, "ranks": [{"torch": torch.get_rng_state()}]},
            "best_val_loss": None, "config": {"training": {"lr": 1e-3}}, **extra}


@pytest.fixture
def good(tmp_path) -> Path:
    return save_checkpoint(tmp_path / "run" / "checkpoint_latest.pt", payload())


def refused(path, match: str, purpose="weights") -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(path, purpose=purpose)
    msg = str(ei.value)
    assert str(path) in msg, msg
    assert match in msg, msg
    assert ei.value.exit_code == EXIT_FAILURE
    return ei.value


# --------------------------------------------------------------------------- good files
def test_roundtrip_and_load_model_from_the_file_alone(good):
    ck = load_checkpoint(good, purpose="resume")
    assert ck["format_version"] == FORMAT_VERSION and ck["step"] == 3
    model, ck2 = load_model(good)
    assert not model.training
    ref = model_lib.create_model(ARGS)
    ref.load_state_dict(payload()["model"])
    x = torch.randint(0, ARGS.vocab_size, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(x)[0], ref.eval()(x)[0])


def test_prefixes_stripped(tmp_path):
    p = payload()
    p["model"] = {"module._orig_mod." + k: v for k, v in p["model"].items()}
    path = save_checkpoint(tmp_path / "c.pt", p)
    model, _ = load_model(path)
    assert set(model.state_dict()) == set(payload()["model"])


# --------------------------------------------------------------------------- bad files
def test_missing_and_empty(tmp_path):
    refused(tmp_path / "nope.pt", "file not found")
    (tmp_path / "empty.pt").write_bytes(b"")
    refused(tmp_path / "empty.pt", "empty file")
    refused(tmp_path, "is a directory")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.95])
def test_truncated(tmp_path, good, keep):
    data = good.read_bytes()
    bad = tmp_path / "trunc.pt"
    bad.write_bytes(data[:int(len(data) * keep)])
    refused(bad, "truncated or corrupt")


def test_random_bytes_and_lfs_pointer_and_text(tmp_path):
    rnd = tmp_path / "random.pt"
    rnd.write_bytes(os.urandom(4096))
    refused(rnd, "not a PyTorch checkpoint")
    zipped = tmp_path / "zip.pt"
    zipped.write_bytes(b"PK\x03\x04" + os.urandom(2000))
    refused(zipped, "truncated or corrupt")
    lfs = tmp_path / "lfs.pt"
    lfs.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    refused(lfs, "Git LFS pointer")


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, ([sys.executable, "-c",
                                   f"open({str(self.marker)!r}, 'w').write('pwned')"],))


@pytest.mark.parametrize("how", ["torch.save", "raw pickle"])
def test_pickled_code_is_refused_and_never_run(tmp_path, how):
    marker = tmp_path / "EXECUTED"
    bad = tmp_path / "evil.pt"
    obj = {"format_version": 1, "model": {}, "model_args": {}, "x": _Evil(marker)}
    if how == "torch.save":
        torch.save(obj, bad)
    else:
        bad.write_bytes(pickle.dumps(obj, protocol=2))
    e = refused(bad, "refused")
    assert "Nothing from it was executed" in str(e) and "weights_only=False" not in str(e)
    # the global named as the file holds it (pickle protocol 2 writes subprocess.call as commands.call)
    assert "pickled Python objects (commands.call) that would run code" in str(e), str(e)
    assert not marker.exists()


def test_missing_entries_and_weights_only_for_resume(tmp_path, good):
    p = payload()
    del p["model_args"]
    refused(save_checkpoint(tmp_path / "a.pt", p), "missing entries: model_args")
    weights_only = {"model": payload()["model"], "model_args": ARGS.to_dict()}
    path = save_checkpoint(tmp_path / "w.pt", weights_only)
    load_checkpoint(path, purpose="weights")
    e = refused(path, "cannot resume training", purpose="resume")
    assert "optimizer" in str(e) and "data_position" in str(e)
    bare = tmp_path / "bare.pt"
    torch.save(payload()["model"], bare)
    refused(bare, "bare state_dict")


def test_nan_weights_and_wrong_shapes_and_newer_format(tmp_path):
    p = payload()
    k = next(iter(p["model"]))
    p["model"][k] = p["model"][k].clone()
    p["model"][k].view(-1)[0] = float("nan")
    refused(save_checkpoint(tmp_path / "nan.pt", p), f"non-finite weights (NaN or inf) in {k}")
    p = payload()
    p["model_args"] = {**ARGS.to_dict(), "d_model": 64}
    refused(save_checkpoint(tmp_path / "shape.pt", p), "shapes disagree")
    p = payload()                                   # refused before any layer is built (no hang)
    p["model_args"] = {**ARGS.to_dict(), "n_layers": 10 ** 12}
    refused(save_checkpoint(tmp_path / "layers.pt", p), "n_layers 1,000,000,000,000 and ffn_hidden 64 make")
    p["model_args"] = {**ARGS.to_dict(), "n_layers": 10 ** 5}
    refused(save_checkpoint(tmp_path / "layers.pt", p), f"n_layers is {10 ** 5} but the weights hold "
                                                          f"{ARGS.n_layers} layers")
    p = payload()
    p["model_args"] = {**ARGS.to_dict(), "max_seq_len": 10 ** 15}
    refused(save_checkpoint(tmp_path / "positions.pt", p), "model.max_seq_len: 1,000,000,000,000,000 positions")
    p = payload()
    path = tmp_path / "new.pt"
    torch.save({**p, "format_version": FORMAT_VERSION + 1}, path)
    refused(path, "newer than this program")
    p = payload()
    p["model"].pop(next(iter(p["model"])))
    refused(save_checkpoint(tmp_path / "miss.pt", p), "missing weights")


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer", "x", "entry 'tokenizer' is a str, not a dict"),
    ("step", "x", "entry 'step' is a str, not a int"),
    ("step", -5, "entry 'step' is -5, below 0"),
    ("step", True, "entry 'step' is a bool"),
    ("step", 10 ** 30, "entry 'step' is 100000000000000000000000..., beyond 64 bits"),
    ("tokens_seen", 1 << 63, "entry 'tokens_seen' is 922337203685477580"),
    ("config", "x", "entry 'config' is a str, not a dict"),
    ("metrics", [], "entry 'metrics' is a list, not a dict"),
    ("rng", 3, "entry 'rng' is a int, not a dict"),
    ("best_val_loss", "low", "entry 'best_val_loss' is a str, not a number"),
    ("kind", "weird", "entry 'kind' is 'weird', not one of pretrain, sft, dpo, rl"),
    ("chat_template", {"user": 5}, "entry 'chat_template' is damaged: name, user_prefix, assistant_prefix, "
                                   "separator are not text"),
    ("chat_template", {"name": "user-assistant-v2", "user_prefix": "U: ", "assistant_prefix": None,
                       "separator": "\n"}, "entry 'chat_template' is damaged: assistant_prefix is not text")])
def test_metadata_entries_of_the_wrong_type_are_refused_by_name(tmp_path, key, value, match):
    """A damaged or forged entry ('tokenizer': "x", 'step': -5) failed wherever a stage first
    read it: an unexpected error in infer, export, sft and resume, or, for step -5, a resumed
    run that trained on from step -5. The loader refuses it, naming the entry."""
    refused(save_checkpoint(tmp_path / "bad.pt", payload(**{key: value})), match)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.bool, torch.int8])
def test_weights_that_are_not_real_floats_are_refused(tmp_path, dtype):
    """Complex weights loaded with a torch warning and lost their imaginary part; integer and
    boolean ones loaded silently. Refused, naming the weight and its dtype."""
    p = payload()
    k = next(iter(p["model"]))
    p["model"][k] = p["model"][k].to(dtype)
    refused(save_checkpoint(tmp_path / "odd.pt", p), f"{k} ({str(dtype).replace('torch.', '')})")


@pytest.mark.parametrize("kind", ["sparse", "sparse_csr", "meta"])
def test_weights_that_are_not_dense_tensors_are_refused(tmp_path, kind):
    """A sparse or meta (shape-only) weight crashed the finiteness check with torch's own
    error (a dispatcher listing for sparse, "Tensor.item() cannot be called on meta tensors"):
    an unexpected error in infer, export and benchmark. Refused, naming the weight."""
    p = payload()
    k = next(k for k, v in p["model"].items() if v.dim() == 2)
    w = p["model"][k]
    with warnings.catch_warnings():                 # "Sparse CSR tensor support is in beta"
        warnings.simplefilter("ignore", UserWarning)
        p["model"][k] = {"sparse": w.to_sparse, "sparse_csr": w.to_sparse_csr,
                         "meta": lambda: torch.empty_like(w, device="meta")}[kind]()
    refused(save_checkpoint(tmp_path / "odd.pt", p), f"not dense tensors with values: {k} (")


def test_cli_error_is_one_paragraph(tmp_path):
    """A stage reading a bad checkpoint exits 1 with the message, no traceback."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(os.urandom(100))
    code = ("import sys; from utils.cli import run_stage; from utils.run import "
            f"load_checkpoint; run_stage(lambda a: load_checkpoint({str(bad)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert str(bad) in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("junk", [b"\x80\xeb" + b"junk" * 50, b"\x80\x02" + bytes(range(256)),
                                  b"\x80\x02}q\x00(X\x05\x00\x00\x00modelq"], ids=["protocol-235", "opcodes", "cut"])
def test_junk_after_a_pickle_header_is_called_damaged_not_code(tmp_path, junk):
    """Bytes that start like a legacy torch file (0x80) and go on as junk: named as a damaged
    file, not as "pickled objects that would run code" (no global was asked for), and torch's
    warning about the junk's "pickle protocol" stays out of the user's terminal."""
    bad = tmp_path / "junk.pt"
    bad.write_bytes(junk)
    code = ("import sys; from utils.cli import run_stage; from utils.run import "
            f"load_checkpoint; run_stage(lambda a: load_checkpoint({str(bad)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=120)
    assert proc.returncode == 1 and str(bad) in proc.stderr, proc.stderr
    assert ("not plain data and tensors" in proc.stderr or "corrupt or not a checkpoint" in proc.stderr), proc.stderr
    assert "would run code" not in proc.stderr and "pickle protocol" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bytes_damaged_inside_a_tensor_are_refused_by_the_stored_checksum(tmp_path, good):
    """Flipped bytes inside a weight's data keep the zip's structure and load as finite, wrong
    weights (torch.load does not check the CRC-32 torch.save stores): resume trained on and
    infer generated from them, exit 0. The loader checks every record's CRC."""
    import zipfile
    with zipfile.ZipFile(good) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)          # the largest tensor
    raw = bytearray(good.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)   # the local header's
    start = info.header_offset + 30 + name_len + extra_len + 8                      # into the data
    for i in range(start, start + 16):
        raw[i] ^= 0xFF
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(raw))
    torch.load(bad, weights_only=True)                               # torch alone takes it
    refused(bad, f"corrupt: the bytes of {info.filename} do not match the checksum", purpose="weights")
    refused(bad, "corrupt", purpose="resume")


def test_a_compressed_record_is_refused_before_it_is_read(tmp_path):
    """torch.save writes stored records only; a deflated one (a zip bomb's way) is refused
    before any of it is decompressed."""
    import zipfile
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * 10_000_000)
    refused(bomb, "is compressed, which torch.save never writes")


# --------------------------------------------------------------------------- runs
def _touch(path: Path, t: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (t, t))


def test_list_runs_newest_first_with_legacy_flat_layout(tmp_path):
    base = tmp_path / "checkpoints"
    now = time.time()
    _touch(base / "old" / "checkpoint_latest.pt", now - 300)
    _touch(base / "new" / "checkpoint_step_10.pt", now - 10)
    _touch(base / "new" / "checkpoint_step_2.pt", now - 20)
    _touch(base / "new" / "checkpoint_best.pt", now - 15)
    _touch(base / "new" / "checkpoint_latest.pt", now - 10)
    _touch(base / "new" / ".checkpoint_latest.pt.tmp-99999", now)      # a killed writer's temp
    _touch(base / "sft_chat" / "checkpoint_best.pt", now - 100)
    _touch(base / "checkpoint_epoch_3.pt", now - 200)                 # the seed's flat layout
    (base / "empty_dir").mkdir()
    runs = list_runs(base)
    assert [r.name for r in runs] == ["new", "sft_chat", "checkpoints (flat layout)", "old"]
    new = runs[0]
    assert [p.name for p in new.checkpoints] == ["checkpoint_best.pt", "checkpoint_latest.pt",
                                                 "checkpoint_step_10.pt", "checkpoint_step_2.pt"]
    assert new.latest.name == "checkpoint_latest.pt" and new.best.name == "checkpoint_best.pt"
    assert runs[1].kind == "sft" and runs[2].legacy and runs[2].latest is None
    assert find_run(base).name == "new"
    assert find_run(base, "old").path == base / "old"
    assert find_run(base, "missing") is None
    assert list_runs(tmp_path / "absent") == []


def test_run_outputs_remove_only_what_a_failed_start_created(tmp_path):
    """utils.run.RunOutputs, the run layer's guard of train and sft train (their CLI tests:
    test_train.py, test_sft.py): a start that fails before begin() leaves no new file or
    folder (folders above the run's that it created included) and every old file as it was;
    after begin() nothing is removed. The logger creates nothing before its first record."""
    from utils.run import RunOutputs
    ck, logs = tmp_path / "checkpoints", tmp_path / "logs"
    old = ck / "r" / "checkpoint_latest.pt"
    _touch(old, 1000.0)
    with pytest.raises(RuntimeError):
        with RunOutputs(ck / "r", logs, "r") as out:
            logger = out.open_logger(tensorboard=False)
            assert not logs.exists()                         # nothing before the first record
            logger.event(0, "start")
            (ck / "r" / "config.json").write_text("{}")
            (ck / "r" / "tokenizer").mkdir()
            (ck / "r" / "tokenizer" / "tokenizer.json").write_text("{}")
            raise RuntimeError("set-up failed")
    assert sorted(tmp_path.rglob("*")) == [ck, ck / "r", old]
    assert old.read_bytes() == b"x" and old.stat().st_mtime == 1000.0
    with pytest.raises(KeyboardInterrupt):                  # Ctrl-C after training began
        with RunOutputs(ck / "n", logs, "n") as out:
            out.open_logger(tensorboard=False).event(0, "start")
            out.begin()
            raise KeyboardInterrupt
    assert (logs / "raw_metrics" / "n.jsonl").is_file()


def test_run_kinds_and_the_chain_of_bases(tmp_path):
    """A run's kind is the stage config it holds (else its folder's prefix); its base is named
    by run folder (``base``), or, in a record from before it, by the folder of its absolute
    ``base_checkpoint`` path; the chain stops at an imported model, a missing base and a loop."""
    from utils.run import base_record, lineage, list_runs, run_kind, runs_started_from
    ck = tmp_path / "checkpoints"

    def run(name, kind=None, base=None):
        d = ck / name
        d.mkdir(parents=True)
        (d / "checkpoint_best.pt").write_bytes(b"x")
        if kind:
            (d / f"{kind}_config.json").write_text(json.dumps(base))
        return d

    run("pre")
    run("sft_a", "sft", {"base_checkpoint": "/old/place/checkpoints/pre/checkpoint_best.pt"})   # old record
    run("my_dpo", "dpo", {"base": base_record(ck / "sft_a" / "checkpoint_best.pt")})
    run("rl_x", "rl", {"base": base_record("/hf/SmolLM2", imported=True)})
    run("rl_orphan")                                  # no stage config: the prefix decides
    run("sft_loop", "sft", {"base": {"run": "sft_loop"}})
    assert {r.name: r.kind for r in list_runs(ck)} == {
        "pre": "pretrain", "sft_a": "sft", "my_dpo": "dpo", "rl_x": "rl", "rl_orphan": "rl",
        "sft_loop": "sft"}
    assert run_kind(ck / "my_dpo") == "dpo"
    assert [r.name for r in runs_started_from(ck, ck / "pre")] == ["sft_a"]
    assert [r.name for r in runs_started_from(ck, ck / "sft_a")] == ["my_dpo"]
    assert lineage(ck, ck / "my_dpo") == ["pre", "sft_a", "my_dpo"]
    assert lineage(ck, ck / "rl_x") == ["(imported) /hf/SmolLM2", "rl_x"]
    assert lineage(ck, ck / "sft_loop") == ["sft_loop", "sft_loop"]
    shutil.rmtree(ck / "pre")
    assert lineage(ck, ck / "my_dpo") == ["pre", "sft_a", "my_dpo"]     # a base gone: named, not followed
