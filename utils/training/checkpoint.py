"""Checkpoint files: the ONE writer and the file half of the ONE loader (library; no side effects).

    save_checkpoint(path, payload)                                atomic (temp file + os.replace)
    ckpt = read_checkpoint(path, purpose="weights"|"resume", shapes_of=...)   validated dict

Stages do not call ``read_checkpoint`` directly: ``utils.run.load_checkpoint`` and
``utils.run.load_model`` add what needs the model (the expected weight names and shapes), so
this module does not import model.py.

Format (``FORMAT_VERSION``): ``torch.save`` of a dict of plain data and tensors only, so
``torch.load(weights_only=True)`` reads it and a checkpoint is never code::

    format_version, kind ("pretrain" | "sft" | "dpo" | "rl"), model (state_dict, no ``_orig_mod.``/``module.``
    prefixes), model_args (ModelArgs.to_dict()), optimizer ({name: optimizer state_dict}),
    scheduler, grad_scaler, step, epoch, tokens_seen, data_position (the loader's state_dict:
    plain ints), rng ({"ranks": [per-rank {"python", "numpy", "torch", "cuda"}]}: tensors and
    plain types), best_val_loss, config (resolved config dict), tokenizer (utils.data.tok.describe),
    chat_template (SFT, or a run started from a public model with one; None otherwise),
    model_rules (a run started from a Hugging Face model: its BOS rule, stop ids and generation
    defaults, utils/data/chat.py), metrics (smoothing window, patience, ...).

An FSDP run's checkpoints are folders with the same entries (utils/training/sharded.py: DCP
shards plus meta.pt), checked by the same :func:`validate`; utils.run.load_checkpoint reads
both forms.

A "weights" load needs format_version, model and model_args; a "resume" load needs the
training state too. Every defect of a file becomes one :class:`CheckpointError` (exit 1)
naming the file and the problem: missing, empty, a Git LFS pointer or other non-checkpoint
file, truncated, pickled code (refused, never run), missing entries, a newer format,
keys/shapes that disagree with the stored model_args, non-finite weights. Cost: a full
load reads the file once and checks every weight for finiteness (one pass over memory).
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from utils.atomic import atomic_open
from utils.disk import bytes_of
from utils.cli import PipelineError
from utils.errors import error_line

FORMAT_VERSION = 1
WEIGHTS_KEYS = ("format_version", "model", "model_args")
RESUME_KEYS = ("optimizer", "scheduler", "step", "epoch", "tokens_seen", "data_position", "rng",
               "best_val_loss", "config")
_PREFIXES = ("_orig_mod.", "module.")
CHECKPOINT_GLOB = "checkpoint_*.pt"
# The metadata entries' types (None allowed, as an entry may be absent): a damaged or forged
# value is refused here, by name, instead of failing wherever a stage first reads it.
ENTRY_TYPES = {"kind": str, "tokenizer": dict, "config": dict, "chat_template": dict, "model_rules": dict,
               "metrics": dict,
               "optimizer": dict, "scheduler": dict, "grad_scaler": dict, "data_position": dict,
               "rng": dict, "step": int, "epoch": int, "tokens_seen": int, "best_val_loss": (int, float)}


class CheckpointError(PipelineError):
    """A checkpoint file that cannot be used: exit code 1, message names the file."""

    def __init__(self, path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"checkpoint {path}: {problem}")


# --------------------------------------------------------------------------- writing
def save_checkpoint(path, payload: dict) -> Path:
    """Write ``payload`` atomically: a crash, SIGKILL or Ctrl-C mid-write leaves the previous
    file under ``path`` intact (at most a hidden ``.NAME.tmp-PID`` sibling remains); a full disk
    (torch.save's RuntimeError included) is a utils.disk.WriteError with the bytes it needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format_version": FORMAT_VERSION, **payload}
    with atomic_open(path, "wb", needed=bytes_of(payload), setting="paths.checkpoints_dir") as f:
        torch.save(payload, f)
    return path


def remove_stale_temps(directory) -> list[Path]:
    """Delete temp files left by a killed writer (``.*.tmp-PID`` whose PID is not alive; the
    temp folders of sharded saves are utils/training/sharded.py's ``recover``'s)."""
    removed = []
    for p in Path(directory).glob(".*.tmp-*"):
        if p.is_dir():
            continue
        try:
            pid = int(p.name.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid != os.getpid() and pid_alive(pid):
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the owner of a temp file or folder)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- reading
def _sniff(path: Path) -> None:
    """Refuse what is plainly not a torch checkpoint before handing it to torch.load."""
    if not path.exists():
        sharded = path.with_suffix(".dcp")
        if path.suffix == ".pt" and sharded.is_dir():
            raise CheckpointError(path, f"file not found; the run is sharded (FSDP): its checkpoint is the "
                                        f"folder {sharded.name}.")
        raise CheckpointError(path, "file not found. List runs with `python main.py status`.")
    if path.is_dir():
        raise CheckpointError(path, "is a directory; pass a checkpoint_*.pt file inside it "
                                    "(or `--resume auto` with `--name RUN`).")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(path, "empty file (0 bytes): the write never completed. Use "
                                    "another checkpoint of the run (checkpoint_step_N.pt).")
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"version https://git-lfs"):
        raise CheckpointError(path, "is a Git LFS pointer file, not the checkpoint itself; "
                                    "fetch the real file with `git lfs pull`.")
    if head.startswith(b"PK\x03\x04"):
        return  # torch's zip format
    if head[:1] == b"\x80":
        return  # legacy (non-zip) torch.save format: a pickle stream; weights_only still applies
    try:
        text = head.decode("utf-8")
        kind = "a text file" if text.isprintable() or "\n" in text else "not a checkpoint"
    except UnicodeDecodeError:
        kind = "not a checkpoint"
    raise CheckpointError(path, f"is {kind} ({size} bytes starting {head[:24]!r}), not a "
                                "PyTorch checkpoint written by this pipeline.")


def _check_crc(path: Path) -> None:
    """Every record of a zip-format checkpoint against the CRC-32 torch.save stored with it
    (torch.load does not look): bytes damaged after the write (a bad copy, a failing disk)
    keep the zip's structure and, in tensor data, load as finite, wrong weights. Costs one
    read of the file, which leaves it in the page cache for torch.load's read. Records written
    without a CRC (0) are skipped. Not done for a memory-mapped read (``mmap``: the report's look
    at a run's metadata), which would otherwise read the optimizer's state it leaves on disk."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.compress_type != zipfile.ZIP_STORED:   # nor read through a zip bomb
                    raise CheckpointError(path, f"record {info.filename[:80]!r} is compressed, which "
                                                "torch.save never writes: not a checkpoint of this "
                                                "pipeline.")
                if info.CRC == 0 or info.is_dir():
                    continue
                with z.open(info) as f:                 # zipfile checks the CRC at the end
                    while f.read(1 << 24):
                        pass
    except zipfile.BadZipFile as e:
        if "CRC" not in str(e):
            raise
        name = str(e).rsplit(" ", 1)[-1].strip("'")     # "Bad CRC-32 for file 'archive/data/0'"
        raise CheckpointError(path, f"corrupt: the bytes of {name} do not match the checksum stored "
                                    "when it was written (damaged since: a bad copy or disk). Use "
                                    "another checkpoint of the run.") from None


def _torch_load(path: Path, map_location, mmap: bool = False) -> Any:
    is_zip = _is_zip_start(path)
    try:
        if is_zip and not mmap:           # mmap: a reader of the metadata (report)
            _check_crc(path)
        with warnings.catch_warnings():   # junk bytes after 0x80 read as a "pickle protocol N"
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and is_zip)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        msg = str(e)
        found = re.findall(r"\bGLOBAL ([\w.]+)", msg)     # torch names each global it refused so
        if not found:                     # an opcode the safe unpickler does not take: junk or forged
            raise CheckpointError(path, "refused: it is not plain data and tensors (the safe unpickler "
                                        f"stopped at: {msg.splitlines()[0][:120] if msg else '?'}): a damaged "
                                        "file, or one not written by this pipeline. Nothing from it was "
                                        "executed.") from None
        raise CheckpointError(path, f"refused: it contains pickled Python objects "
                                    f"({', '.join(sorted(set(found)))}) that would run code when loaded. A "
                                    "checkpoint must be plain data and tensors; this file was not written "
                                    "by this pipeline or has been tampered with. Nothing from it was "
                                    "executed.") from None
    except (zipfile.BadZipFile, EOFError) as e:
        raise CheckpointError(path, f"truncated or corrupt ({type(e).__name__}); the write was "
                                    "probably interrupted. Use another checkpoint of the run.") from None
    except RuntimeError as e:
        msg = str(e)
        if any(s in msg for s in ("zip archive", "central directory", "PytorchStreamReader",
                                  "unexpected EOF", "file_size", "storage")):
            raise CheckpointError(path, "truncated or corrupt (the zip archive is incomplete); "
                                        "the write was probably interrupted. Use another "
                                        "checkpoint of the run.") from None
        raise CheckpointError(path, f"cannot be read: {msg.splitlines()[0][:200]}") from None
    except OSError as e:
        if is_zip:                # torch's reader hits an offset past the end of a cut file
            raise CheckpointError(path, "truncated or corrupt (the zip archive is incomplete: "
                                        f"{e.strerror or e}); the write was probably "
                                        "interrupted. Use another checkpoint of the run.") from None
        raise CheckpointError(path, f"cannot be read: {e.strerror or e}") from None
    except Exception as e:  # any other malformed content
        raise CheckpointError(path, f"corrupt or not a checkpoint: it cannot be read "
                                    f"({error_line(e)}). Use another "
                                    "checkpoint of the run.") from None


def _is_zip_start(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def strip_prefixes(state_dict: dict) -> dict:
    """Remove torch.compile's ``_orig_mod.`` and DDP's ``module.`` key prefixes (any nesting)."""
    out = {}
    for k, v in state_dict.items():
        changed = True
        while changed:
            changed = False
            for p in _PREFIXES:
                if k.startswith(p):
                    k, changed = k[len(p):], True
        out[k] = v
    return out


def check_weights(path: Path, ckpt: dict, expected: Optional[dict]) -> None:
    """Keys and shapes against ``expected`` ({name: shape}, from the model its model_args
    build; None skips that part), every weight a real floating-point tensor, and finite."""
    sd = ckpt["model"]
    problems = []
    if expected is not None:
        missing = [k for k in expected if k not in sd]
        unexpected = [k for k in sd if k not in expected]
        bad = [f"{k} {tuple(sd[k].shape)} vs {expected[k]}" for k in expected
               if k in sd and tuple(sd[k].shape) != tuple(expected[k])]
        if missing:
            problems.append(f"missing weights {_few(missing)}")
        if unexpected:
            problems.append(f"unexpected weights {_few(unexpected)}")
        if bad:
            problems.append(f"shapes disagree with the stored model config: {_few(bad)}")
    if problems:
        raise CheckpointError(path, "; ".join(problems) + ". The weights do not belong to the "
                                    "model its model_args describe (edited or mixed-up file).")
    unreal = [f"{k} ({'meta' if v.device.type == 'meta' else 'nested' if v.is_nested else v.layout})"
              for k, v in sd.items() if v.layout != torch.strided or v.device.type == "meta" or v.is_nested]
    if unreal:
        raise CheckpointError(path, f"weights that are not dense tensors with values: {_few(unreal)}. "
                                    "A checkpoint's weights are dense (strided) tensors; sparse, nested or "
                                    "meta (shape-only) ones come from an edited or foreign file.")
    odd = [f"{k} ({str(v.dtype).replace('torch.', '')})" for k, v in sd.items()
           if v.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64)]
    if odd:
        raise CheckpointError(path, f"weights that are not real floating-point numbers: {_few(odd)}. "
                                    "A checkpoint's weights are float32, float16 or bfloat16 (complex "
                                    "ones lost their imaginary part on load, integer and boolean ones "
                                    "were taken silently): an edited or foreign file.")
    nonfinite = [k for k, v in sd.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if nonfinite:
        raise CheckpointError(path, f"non-finite weights (NaN or inf) in {_few(nonfinite)}: "
                                    "training diverged before this save. Use an earlier "
                                    "checkpoint (checkpoint_best.pt or checkpoint_step_N.pt) "
                                    "and a lower training.lr.")


KINDS = ("pretrain", "sft", "dpo", "rl")                # what the trainer writes (TrainSpec.kind)
TEMPLATE_TEXTS = ("name", "user_prefix", "assistant_prefix", "separator")   # every template of ours: its texts
JINJA_TEXTS = ("name", "template")                                         # a public model's template


def _check_kind_and_template(path: Path, ckpt: dict) -> None:
    """``kind`` is one the trainer writes (another ran as a pre-trained model, silently), and
    a chat template holds its text fields as text (a damaged one was reported as a template
    "None" from a newer pipeline). A template name this version does not know is left to
    utils/data/sft.py ``template_version``, which asks for an update."""
    kind = ckpt.get("kind")
    if kind is not None and kind not in KINDS:
        raise CheckpointError(path, f"entry 'kind' is {kind[:40]!r}, not one of {', '.join(KINDS)}: a "
                                    "damaged checkpoint. Use another checkpoint of the run.")
    template = ckpt.get("chat_template")
    if template is not None:
        texts = JINJA_TEXTS if template.get("name") == "jinja" else TEMPLATE_TEXTS
        bad = [k for k in texts if not isinstance(template.get(k), str)]
        if bad:
            raise CheckpointError(path, f"entry 'chat_template' is damaged: {', '.join(bad)} "
                                        f"{'is' if len(bad) == 1 else 'are'} not text. Use another "
                                        "checkpoint of the run.")


def _check_model_rules(path: Path, ckpt: dict) -> None:
    """``model_rules`` (utils/data/chat.py) holds what its reader takes: a true/false BOS rule,
    token ids, and sampling settings of the right types (a damaged one is named here)."""
    rules = ckpt.get("model_rules")
    if rules is None:
        return
    stops, defaults, files = rules.get("stop_ids", []), rules.get("defaults", {}), rules.get("files")
    files_ok = files is None or (isinstance(files, dict) and isinstance(files.get("config"), dict)
                                 and isinstance(files.get("generation"), (dict, type(None))))
    ok = (files_ok and isinstance(rules.get("add_bos", False), bool) and isinstance(stops, list)
          and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in stops)
          and isinstance(defaults, dict)
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in defaults.values()))
    if not ok:
        raise CheckpointError(path, "entry 'model_rules' is damaged (add_bos must be true or false, stop_ids "
                                    "token ids, defaults numbers, files the model's config objects). Use "
                                    "another checkpoint of the run.")


def _few(items: list, n: int = 4) -> str:
    shown = ", ".join(map(str, items[:n]))
    return shown + (f" (and {len(items) - n} more)" if len(items) > n else "")


def read_checkpoint(path, purpose: str = "weights", map_location="cpu",
                    shapes_of: Optional[Callable[[dict, dict], dict]] = None, mmap: bool = False) -> dict:
    """A checkpoint file: ``torch.load(weights_only=True)`` plus validation. Stages open
    checkpoints through ``utils.run.load_checkpoint``, which passes ``shapes_of`` ((model_args
    dict, weights) -> {weight name: shape}, from the model those args build): the file layer
    does not know the model.

    purpose "weights": needs the model and its config (SFT, inference, benchmark, export);
    purpose "resume": also the optimizer, scheduler, step, data position and RNG states.
    Returns the payload dict with prefix-free model keys. Raises :class:`CheckpointError`.
    ``mmap``: tensors are memory-mapped from the file (torch's zip format), so the optimizer
    state is never read into memory (the weights still are, by the finiteness check).
    """
    if purpose not in ("weights", "resume"):
        raise ValueError(f"purpose must be 'weights' or 'resume', not {purpose!r}")
    path = Path(path)
    _sniff(path)
    return validate(path, _torch_load(path, map_location, mmap), purpose, shapes_of)


def validate(path: Path, ckpt, purpose: str, shapes_of: Optional[Callable[[dict, dict], dict]] = None,
             weights: bool = True) -> dict:
    """The checks of :func:`read_checkpoint` on a loaded payload (a plain file's, or a sharded
    checkpoint's, utils/training/sharded.py); ``weights`` False: the weights are names only
    (their shapes were checked elsewhere), so their values are not looked at."""
    _check_layout(path, ckpt)
    _check_entry_types(path, ckpt)
    _check_kind_and_template(path, ckpt)
    _check_model_rules(path, ckpt)
    if purpose == "resume":
        _check_resumable(path, ckpt)
    ckpt["model"] = strip_prefixes(ckpt["model"])
    if weights:
        expected = None
        if shapes_of is not None:
            try:
                expected = shapes_of(dict(ckpt["model_args"]), ckpt["model"])
            except Exception as e:   # whatever the stored args get wrong: the file is unusable
                raise CheckpointError(path, f"model_args cannot rebuild the model: {e}") from None
        check_weights(path, ckpt, expected)
    ckpt.setdefault("kind", "pretrain")
    ckpt.setdefault("chat_template", None)
    return ckpt


def _check_layout(path: Path, ckpt) -> None:
    """The pipeline's checkpoint dict: a format version this program reads, the weights
    entries, a state dict of tensors and a dict of model settings."""
    if not isinstance(ckpt, dict):
        raise CheckpointError(path, f"is not a checkpoint: it holds a {type(ckpt).__name__}, "
                                    "not the pipeline's checkpoint dict.")
    if "format_version" not in ckpt and "model" not in ckpt and ckpt and all(
            isinstance(v, torch.Tensor) for v in ckpt.values()):
        raise CheckpointError(path, "is a bare state_dict (weights only, no model config): the "
                                    "model cannot be rebuilt from it. Missing entries: "
                                    + ", ".join(WEIGHTS_KEYS[::2]) + ".")
    version = ckpt.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(path, f"format version {version} is newer than this program reads "
                                    f"(up to {FORMAT_VERSION}); update the pipeline (git pull).")
    missing = [k for k in WEIGHTS_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(path, f"missing entries: {', '.join(missing)} (not a checkpoint "
                                    "written by this pipeline, or an incomplete one).")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(path, f"format_version {version!r} is not a valid version number.")
    if not isinstance(ckpt["model"], dict) or not all(
            isinstance(v, torch.Tensor) for v in ckpt["model"].values()):
        raise CheckpointError(path, "entry 'model' is not a state_dict of tensors.")
    if not isinstance(ckpt["model_args"], dict):
        raise CheckpointError(path, "entry 'model_args' is not a dict of model settings.")


def _check_entry_types(path: Path, ckpt: dict) -> None:
    """Each entry of ENTRY_TYPES present has its type (counters: 0 <= n < 2**63)."""
    for key, kind in ENTRY_TYPES.items():
        v = ckpt.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, kind):
            want = "a number" if key == "best_val_loss" else f"a {kind.__name__}"
            raise CheckpointError(path, f"entry {key!r} is a {type(v).__name__}, not {want}: a damaged "
                                        "checkpoint. Use another checkpoint of the run.")
        if kind is int and v < 0:
            raise CheckpointError(path, f"entry {key!r} is {v}, below 0: a damaged checkpoint. Use "
                                        "another checkpoint of the run.")
        if kind is int and v >= 1 << 63:
            raise CheckpointError(path, f"entry {key!r} is {str(v)[:24]}..., beyond 64 bits: a damaged "
                                        "checkpoint. Use another checkpoint of the run.")


def _check_resumable(path: Path, ckpt: dict) -> None:
    """The training state an exact resume needs is there."""
    missing = [k for k in RESUME_KEYS if k not in ckpt or (ckpt[k] is None and k != "best_val_loss")]
    if missing:
        raise CheckpointError(
            path, f"cannot resume training from it: missing {', '.join(missing)} (a "
                  "weights-only checkpoint: it has the model but not the optimizer, "
                  "schedule, data position and RNG state an exact resume needs). Use it for "
                  "inference, benchmark or sft, or start a new run without --resume.")
