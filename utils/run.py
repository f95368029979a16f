"""The run layer: the one module that knows run folders and opens what is in them
(library; no side effects).

Run folders (``paths.checkpoints_dir/<run>/``; SFT runs are ``sft_<name>_<stamp>``, and the
seed's old flat layout of ``*.pt`` files directly in the folder is one "legacy" run):

    runs = list_runs(checkpoints_dir)           newest first (RunInfo: name, path, kind, checkpoints)
    run = find_run(checkpoints_dir, name=None)  the named run, or the newest
    run_checkpoints(folder)                     its ``*.pt`` files: best, latest, then newest step
    newest_checkpoint(folder)                   the one a save completed last (elastic restarts)
    stored_config(folder) / read_stage_config(folder)   what the run folder keeps of its config
    base_record(path) / lineage(checkpoints_dir, folder)   what a post-training run starts from,
                                                by run folder name (survives moving the project)
    runs_started_from(checkpoints_dir, folder)  the SFT, DPO and RL runs started from the run
    pick_checkpoint(path, say)                  a file as given; a folder: its best (else latest)
    is_hf_model(path)                           a Hugging Face folder / .gguf file, not a run of ours
    resume_checkpoint(checkpoints_dir, spec, name=None, prefix=None)   ``--resume PATH|auto``
    resume_command_train(...) / resume_command_post(...)   what the user runs to continue
    with RunOutputs(run_dir, logs_dir, run) as out:   what train / sft train write for a run: a
        logger = out.open_logger(...); ...           start that fails before out.begin() leaves
        out.begin()                                  nothing new behind, nothing old changed

Checkpoints (the one loader; the file format itself is ``utils/training/checkpoint.py``):

    ckpt = load_checkpoint(path, purpose="weights"|"resume")   validated against the model
                                                                 (a LoRA run's adapter merged
                                                                 for "weights": utils/lora.py)
    model, ckpt = load_model(path, device)                       rebuilt from ckpt["model_args"]
    model, ckpt, tok, info = load_model_and_tokenizer(path, cfg, device)   with its own tokenizer
    tok, info = tokenizer_for_checkpoint(ckpt, cfg, path)        the tokenizer it was trained with
    require_same_tokenizer(have, want, ...)                     the one fingerprint check

Tokenizers. Contract: a checkpoint opens with the tokenizer it was trained with, whatever today's
config.json names. :func:`tokenizer_for_checkpoint` looks, in order, at

1. the run's own tokenizer: what the checkpoint's stored config resolves to (its saved copy
   under the run's ``tokenizers/`` folder, else its ``tokenizer.name``, relative paths taken
   against the run's ``paths.root``), then the ``name`` the checkpoint's tokenizer record
   gives, against the same root;
2. the copy the run folder keeps (``<run>/tokenizer/``, :func:`save_run_tokenizer`: train and
   sft write it), so a run folder copied to another machine opens without its tokenizer;
3. the configured tokenizer (``--config`` / config.json), when it names something else;

and takes the first whose fingerprint equals the one stored in the checkpoint (a checkpoint
without a fingerprint, from before fingerprints, takes the first that loads). When the
configured tokenizer names something other than what was used, it says so once. When none
matches, one error names the fingerprint, every place it looked and why each was refused,
and what to do. infer, sft train, benchmark and status need no ``--config`` to open a run.

Cost: loading a tokenizer (the slow part) and its fingerprint; ``cache`` (a dict the caller
keeps) makes several checkpoints of one run pay once.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from utils.cli import PipelineError, UsageError, argv_without
from utils.config import Config, apply_layer
from utils.training.logging_utils import DualLogger, log_paths

# status lists runs and reads their folders through this module and opens no model nor
# tokenizer: what does is imported where it is opened: torch (model.py, checkpoint files; ~2 s),
# transformers (utils/hf/import_hf.py), the tokenizer and chat modules (huggingface_hub, numpy,
# jinja2; ~0.3 s, as long as status itself takes).


# --------------------------------------------------------------------------- checkpoints
def model_args_of(ckpt: dict, path: Path):
    """``ModelArgs`` from a checkpoint's stored dict, or CheckpointError."""
    from model import ModelArgs                                  # torch (see the imports)
    from utils.training.checkpoint import CheckpointError        # torch
    try:
        return ModelArgs.from_dict(dict(ckpt["model_args"]))
    except Exception as e:      # whatever the stored args get wrong: the file is unusable
        raise CheckpointError(path, f"model_args cannot rebuild the model: {e}") from None


def _weight_shapes(model_args: dict, weights: Optional[dict] = None) -> dict:
    """{weight name: shape} of the model ``model_args`` build (on the meta device: no memory).
    ``weights`` (the checkpoint's): their layer count is checked first, so stored args that ask
    for a trillion layers fail at once instead of building them one by one."""
    import torch                                                 # (see the imports)
    from model import ModelArgs, create_model, layer_count       # torch
    args = ModelArgs.from_dict(model_args)
    if weights is not None:
        held = layer_count(weights)
        if args.n_layers != held:
            raise ValueError(f"n_layers is {args.n_layers} but the weights hold {held} layers")
    with torch.device("meta"):
        ref = create_model(args)
    return {k: tuple(v.shape) for k, v in ref.state_dict().items()}


def load_checkpoint(path, purpose: str = "weights", map_location="cpu", mmap: bool = False,
                    merge_lora: bool = True, tensors: bool = True) -> dict:
    """The one checkpoint loader (``read_checkpoint``'s checks, plus the weights' names and
    shapes against the model the stored model_args build). purpose "weights": what SFT,
    inference, benchmark and export need; "resume": also the full training state. ``mmap``:
    tensors stay in the file (memory-mapped) until touched, for readers of the metadata.
    ``merge_lora`` False: a LoRA run's adapter stays apart for "weights" too (export's
    adapter folder). A sharded checkpoint (a ``*.dcp`` folder of an FSDP run,
    utils/training/sharded.py) reads as a file does: the same dict, its tensors consolidated
    in this process; ``tensors`` False: none read (an FSDP resume loads them rank by rank)."""
    from utils.training import sharded                           # torch (see the imports)
    from utils.training.checkpoint import read_checkpoint        # torch (see the imports)
    if sharded.is_sharded(path):
        if purpose not in ("weights", "resume"):
            raise ValueError(f"purpose must be 'weights' or 'resume', not {purpose!r}")
        ckpt = sharded.read(path, purpose, shapes_of=_weight_shapes, tensors=tensors)
    else:
        ckpt = read_checkpoint(path, purpose, map_location, shapes_of=_weight_shapes, mmap=mmap)
    if ckpt.get("lora") is not None:
        _open_adapter(ckpt, Path(path), merge=purpose == "weights" and merge_lora)
    return ckpt


def _open_adapter(ckpt: dict, path: Path, merge: bool) -> None:
    """A LoRA run's checkpoint (utils/lora.py): its adapter validated against the base weights;
    for readers of weights (``merge``) merged into ``"model"``, the entry then keeping its
    settings and ``"merged": True`` (no tensors: nothing can merge it twice); a resume gets
    them apart."""
    from utils import lora                                       # torch (see the imports)
    from utils.training.checkpoint import CheckpointError        # torch
    entry = ckpt["lora"]
    try:
        settings = lora.check_entry(entry, {k: tuple(v.shape) for k, v in ckpt["model"].items()})
    except ValueError as e:
        raise CheckpointError(path, f"its LoRA adapter is damaged: {e}") from None
    if merge:
        ckpt["model"] = lora.merged(ckpt["model"], entry)
        ckpt["lora"] = {**settings.to_dict(), "merged": True}


def load_model(path, device="cpu"):
    """``(model, ckpt)``: the model rebuilt from ``ckpt["model_args"]`` with its weights, in eval
    mode on ``device``."""
    from model import create_model                               # torch (see the imports)
    ckpt = load_checkpoint(path, purpose="weights", map_location="cpu")
    model = create_model(model_args_of(ckpt, Path(path)))
    model.load_state_dict(ckpt["model"], strict=True)
    model.to(device)
    model.eval()
    return model, ckpt


def load_model_and_tokenizer(path, cfg: Config, device="cpu", say: Callable[[str], None] = print,
                             cache: Optional[dict] = None):
    """``(model, ckpt, tok, tok_info)``: :func:`load_model` with the tokenizer the checkpoint was
    trained with (:func:`tokenizer_for_checkpoint`), refused when the model has fewer
    embedding rows than the tokenizer has tokens."""
    model, ckpt = load_model(path, device=device)
    tok, info = tokenizer_for_checkpoint(ckpt, cfg, Path(path), say=say, cache=cache)
    if model.args.vocab_size < len(tok):
        raise PipelineError(f"checkpoint {path} has a vocabulary of {model.args.vocab_size} "
                            f"tokens, smaller than the tokenizer's {len(tok)}.")
    return model, ckpt, tok, info


@dataclasses.dataclass
class Opened:
    """A model opened to generate with (``open_for_generation``)."""
    path: Path             # the checkpoint file (a run folder resolved), or the HF folder / .gguf
    label: str             # run/checkpoint (HF: the folder or file name)
    model: object
    kind: str              # "pretrain", "sft" or "hf"
    rules: object          # utils.data.chat.Rules: chat template (None with raw), BOS, stop ids, defaults
    tok: object

    @property
    def template(self) -> Optional[dict]:
        """The chat template it chats with, or None (plain completions)."""
        return self.rules.template


def open_for_generation(path, cfg: Config, device="cpu", say: Callable[[str], None] = print,
                        raw: bool = False, cache: Optional[dict] = None) -> Opened:
    """A checkpoint file, a run folder (its best checkpoint, :func:`pick_checkpoint`), or a
    Hugging Face Llama folder / .gguf file (imported, utils/hf/import_hf.py), with its
    tokenizer and its rules (utils/data/chat.py): an SFT checkpoint's template, a public
    model's own; ``raw``: no template (plain completions)."""
    from utils.data.chat import rules_of_checkpoint              # jinja2 (see the imports)
    from utils.hf.import_hf import load_hf_llama                 # torch, transformers
    path = Path(path)
    if is_hf_model(path):
        imported = load_hf_llama(path)
        rules = imported.rules.without_template() if raw else imported.rules
        return Opened(path, path.name, imported.model.to(device), "hf", rules, imported.tok)
    path = pick_checkpoint(path, say=say)
    model, ckpt, tok, _ = load_model_and_tokenizer(path, cfg, device, say=say, cache=cache)
    rules = rules_of_checkpoint(ckpt, tok)
    return Opened(path, f"{path.parent.name}/{path.name}", model, ckpt.get("kind", "pretrain"),
                  rules.without_template() if raw else rules, tok)


# --------------------------------------------------------------------------- run folders
@dataclasses.dataclass
class RunInfo:
    """One training run folder (or the legacy flat layout: ``legacy=True``)."""
    name: str
    path: Path
    kind: str                      # "pretrain", a post-training kind (POST_TRAINING) or "legacy"
    checkpoints: list              # Paths, best and latest first, then steps/epochs newest first
    mtime: float                   # newest file in the run

    @property
    def latest(self) -> Optional[Path]:
        return self._named("checkpoint_latest")

    @property
    def best(self) -> Optional[Path]:
        return self._named("checkpoint_best")

    def _named(self, stem: str) -> Optional[Path]:
        """``stem.pt``, or the sharded folder ``stem.dcp`` of an FSDP run."""
        return next((p for p in self.checkpoints if p.stem == stem), None)

    @property
    def legacy(self) -> bool:
        return self.kind == "legacy"


def check_run_name(name: str, what: str = "run name") -> str:
    """``name`` if it is a run name: one folder name under paths.checkpoints_dir, never a path
    (``../x``, ``/abs``, ``a/b``, ``.``: a run written there would land outside the
    checkpoints folder, or be the folder itself); else a UsageError naming ``what``."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UsageError(f"{what} {name!r} is not a run name: give one folder name, not a path (no "
                         "'/' or '\\', not '.' or '..', no control characters; `python main.py status` "
                         "lists the runs).")
    size = len(name.encode("utf-8", "surrogateescape"))
    if size > RUN_NAME_MAX_BYTES:
        raise UsageError(f"{what} {name[:40]!r}... is {size} bytes "
                         f"long: give at most {RUN_NAME_MAX_BYTES} (its log and report file names add "
                         "to it, and a file system takes 255 per name).")
    return name


RUN_NAME_MAX_BYTES = 128


def _ckpt_order(p: Path) -> tuple:
    name = p.stem
    if name == "checkpoint_best":
        return (0, 0)
    if name == "checkpoint_latest":
        return (1, 0)
    m = re.search(r"(\d+)$", name)
    return (2, -int(m.group(1)) if m else 0, name)


SHARDED_GLOB = "*.dcp"      # an FSDP run's sharded checkpoint folders (utils/training/sharded.py)


def run_checkpoints(directory) -> list[Path]:
    """The checkpoints of a run folder: its ``*.pt`` files and the ``*.dcp`` folders of a
    sharded (FSDP) run, no temp files or folders; best/latest first."""
    d = Path(directory)
    files = [p for p in d.glob("*.pt") if p.is_file() and not p.name.startswith(".")]
    files += [p for p in d.glob(SHARDED_GLOB) if p.is_dir() and not p.name.startswith(".")]
    return sorted(files, key=_ckpt_order)


def newest_checkpoint(directory) -> Optional[Path]:
    """The checkpoint of a run folder written last (what a restarted worker continues from):
    checkpoint_latest or a numbered one, whichever a save completed last (a numbered
    checkpoint written after the last validation is newer than checkpoint_latest; best is
    never newer than latest). A sharded folder counts by its manifest, written last; a folder
    without one is no checkpoint. None when the run has none."""
    done = {}
    for p in run_checkpoints(directory):
        if p.stem == "checkpoint_best":
            continue
        mark = p / "manifest.json" if p.is_dir() else p
        if mark.is_file():
            done[p] = mark.stat().st_mtime_ns
    return max(done, key=done.get) if done else None


def checkpoint_bytes(path) -> int:
    """A checkpoint's size on disk: a file's, or the files of a sharded folder added up."""
    p = Path(path)
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    return p.stat().st_size


def list_runs(checkpoints_dir) -> list[RunInfo]:
    """Runs under ``checkpoints_dir``, newest first: every sub-folder holding checkpoints
    (its kind: :func:`run_kind`) plus, when ``*.pt`` files sit directly in the folder
    (the seed's old flat layout), one "legacy" run named after the folder."""
    base = Path(checkpoints_dir)
    runs: list[RunInfo] = []
    if not base.is_dir():
        return runs
    for d in base.iterdir():
        if not d.is_dir() or d.name.startswith("."):
            continue
        files = run_checkpoints(d)
        if not files:
            continue
        kind = run_kind(d)
        mtime = max(p.stat().st_mtime for p in files)
        runs.append(RunInfo(d.name, d, kind, files, mtime))
    flat = run_checkpoints(base)
    if flat:
        runs.append(RunInfo(f"{base.name} (flat layout)", base, "legacy", flat,
                            max(p.stat().st_mtime for p in flat)))
    runs.sort(key=lambda r: r.mtime, reverse=True)
    return runs


def find_run(checkpoints_dir, name: Optional[str] = None) -> Optional[RunInfo]:
    """The named run, or the newest one when ``name`` is None."""
    runs = list_runs(checkpoints_dir)
    if name is None:
        return runs[0] if runs else None
    return next((r for r in runs if r.name == name), None)


def pick_checkpoint(path, say: Callable[[str], None] = lambda s: None) -> Path:
    """``path`` itself when it is a file or a sharded checkpoint folder (``*.dcp``); for a run
    folder its best checkpoint (else latest, else the newest step), said in one line."""
    path = Path(path)
    if not path.is_dir() or path.suffix == ".dcp":
        return path
    files = run_checkpoints(path)
    if not files:
        raise PipelineError(f"{path} is a folder without checkpoint files (*.pt, or *.dcp folders of a sharded run); pass "
                            "a checkpoint file or a run folder that holds one.")
    say(f"using {files[0].name} of {path}")
    return files[0]


def is_hf_model(path) -> bool:
    """A Hugging Face model folder (config.json) or a .gguf file, not a run folder of ours:
    what utils/hf/import_hf.py opens instead of :func:`pick_checkpoint`."""
    path = Path(path)
    return (path.is_file() and path.suffix == ".gguf") or (
        path.is_dir() and (path / "config.json").is_file() and not any(path.glob("*.pt"))
        and not any(path.glob(SHARDED_GLOB)))


def age_text(seconds: float) -> str:
    """A short human age: '45 s', '12 min', '3.5 h', '2.0 days'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


# --------------------------------------------------------------------------- resuming
def resume_checkpoint(checkpoints_dir, spec: str, name: Optional[str] = None,
                      prefix: Optional[str] = None) -> Path:
    """The checkpoint ``--resume spec`` means: a path as given; ``auto``: the latest
    checkpoint of run ``name`` (or of the newest run), or with ``prefix`` (a post-training
    run's ``<kind>_<name>_``) the checkpoint_latest.pt of the newest run so named."""
    if spec != "auto":
        return Path(os.path.expanduser(spec)).resolve()
    if prefix is not None:
        runs = [r for r in list_runs(checkpoints_dir) if r.name.startswith(prefix) and r.latest is not None]
        if not runs:
            raise PipelineError(f"--resume auto: no {prefix}* run with a "
                                f"checkpoint_latest.pt under {checkpoints_dir}.")
        return runs[0].latest
    run = find_run(checkpoints_dir, name)
    if run is None:
        what = f"run '{name}'" if name else "any run"
        raise PipelineError(f"--resume auto: no checkpoints of {what} under {checkpoints_dir}. "
                            "Start it without --resume, or pass a checkpoint path.")
    return run.latest or run.checkpoints[0]


def resume_command_train(argv: Sequence[str], run: str, world_size: int,
                         local_world_size: Optional[int] = None,
                         nodes: Optional[Sequence[str]] = None) -> str:
    """The command that continues a pre-training run: main.py's, with ``--nproc-per-node``
    for DDP on one machine, and with ``nodes`` (the launch flags ``main.py train --nnodes``
    gave, without the node rank) on each of several machines; torchrun's when the ranks span
    several machines that torchrun started by hand (its rendezvous flags are the user's to add)."""
    rest = argv_without(argv, ("--resume", "--name")) + ["--name", run, "--resume", "auto"]
    if nodes:
        return (f"python main.py train {shlex.join([*rest, *nodes])} --node-rank R   (on each "
                "node, R its own node rank)")
    local = world_size if local_world_size is None else local_world_size
    if world_size > 1 and local != world_size:
        return f"torchrun --nproc_per_node={local} train.py {shlex.join(rest)}"
    if world_size > 1:
        rest += ["--nproc-per-node", str(world_size)]
    return f"python main.py train {shlex.join(rest)}"


def resume_command_post(command: str, argv: Sequence[str], latest: Path) -> str:
    """The command that continues a post-training run from its ``latest`` checkpoint
    (``command``: ``sft train``, ``dpo train``, ``rl``; ``argv``: the arguments after it)."""
    out = argv_without(list(argv), ("--resume", "--checkpoint", "--init-from-hf"))
    return f"python main.py {command} " + shlex.join(out + ["--resume", str(latest)])


# --------------------------------------------------------------------------- run outputs
class RunOutputs:
    """What a training stage (train, sft train) writes for its run: the run folder (checkpoints,
    its config, the tokenizer copy), ``logs/tensorboard/<run>/`` and
    ``logs/raw_metrics/<run>.jsonl``, with the folders above them. Used around the stage's
    set-up::

        with RunOutputs(run_dir, logs_dir, run, enabled=is_main) as out:
            logger = out.open_logger(tensorboard=..., jsonl=..., purge_step=...)
            ...                    # the set-up that can still fail: data, model, resume state
            ...                    # then the run's own files (config, tokenizer copy, config record)
            out.begin()            # training starts: from here on everything written is kept

    Contract: a start that fails before :meth:`begin` (an exception, Ctrl-C included) leaves
    nothing new behind, and whatever existed before is never removed or changed. Creation is
    lazy: the logger creates its folder and file at its first record, and the stage writes
    the run's files after the last refusal a resume can meet (its training state loading), so
    a refused start creates nothing. Whatever a start that fails later in its set-up did
    create is removed on the way out: the files and folders of these places that did not exist
    when the block was entered (the logger is closed first), then each folder above them that
    the block created and that is empty. After :meth:`begin` nothing is removed: a run that
    fails while training keeps its log and checkpoints, the record of what happened.
    ``enabled=False`` (DDP ranks other than 0, which write nothing) watches nothing and gives a
    logger that does nothing."""

    def __init__(self, run_dir, logs_dir, run: str, enabled: bool = True):
        self.run, self.logs_dir, self.enabled = run, Path(logs_dir), enabled
        self.places = [Path(run_dir), *log_paths(logs_dir, run)]
        self.begun = False
        self._logger = None
        self._before: set = set()
        self._new_parents: list = []

    def __enter__(self) -> "RunOutputs":
        if self.enabled:
            for place in self.places:
                self._before |= set(_tree(place))
                parent = place.parent
                while not parent.exists() and parent != parent.parent:
                    self._new_parents.append(parent)
                    parent = parent.parent
        return self

    def open_logger(self, **kw):
        """The run's DualLogger (utils/training/logging_utils.py), closed on a failed start."""
        self._logger = DualLogger(self.run, self.logs_dir, enabled=self.enabled, **kw)
        return self._logger

    def begin(self) -> None:
        """Training starts: from here on, nothing the stage writes is removed."""
        self.begun = True

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.enabled and not self.begun:
            self._remove_new()
        return False

    def _remove_new(self) -> None:
        kept: list[str] = []                # what could not be removed, said once
        if self._logger is not None:
            try:
                self._logger.close()
            except OSError as e:            # the stage's own error is the one to report
                kept.append(f"the log ({e.strerror or e})")
        new = [p for place in self.places for p in _tree(place) if p not in self._before]
        for p in sorted(new, key=lambda p: len(p.parts), reverse=True):   # contents first
            try:
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()               # emptied by the loop (contents first)
                else:
                    p.unlink()
            except OSError as e:
                kept.append(f"{p} ({e.strerror or e})")
        for d in sorted(set(self._new_parents), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:                 # not empty (another run wrote there: kept on purpose) or gone
                pass
        if kept:
            print(f"note: the failed start could not remove what it created: {'; '.join(kept[:5])}"
                  + (f" and {len(kept) - 5} more" if len(kept) > 5 else ""), file=sys.stderr)


def _tree(place: Path) -> list[Path]:
    """``place`` and, for a folder, everything under it (links not followed); [] if absent."""
    if not place.exists() and not place.is_symlink():
        return []
    out = [place]
    if place.is_dir() and not place.is_symlink():
        for root, dirs, files in os.walk(place):
            out += [Path(root) / n for n in dirs + files]
    return out


# --------------------------------------------------------------------------- tokenizers
def require_same_tokenizer(have: Optional[dict], want: Optional[dict], have_what: str,
                           want_what: str, fix: str) -> None:
    """The one tokenizer-fingerprint check: ``have`` and ``want`` are tokenizer records
    (``utils.data.tok.describe``); a record without a fingerprint (older files) passes.
    The error names both sides, both fingerprints, and ``fix``."""
    have, want = have or {}, want or {}
    a, b = have.get("fingerprint"), want.get("fingerprint")
    if a and b and a != b:
        raise PipelineError(
            f"tokenizer mismatch: {have_what} was made with tokenizer '{have.get('name')}' "
            f"(fingerprint {str(a)[:12]}), but {want_what} with '{want.get('name')}' "
            f"(fingerprint {str(b)[:12]}). {fix}")


def run_config(ckpt: dict) -> Optional[Config]:
    """The config a checkpoint was trained with (its stored, resolved config), or None when it
    holds none or the stored one no longer validates."""
    return _config_from(ckpt.get("config"))


def _config_from(stored) -> Optional[Config]:
    """A stored, resolved config dict as a Config (``_meta.test`` restored), or None when it is
    not a dict or no longer validates."""
    if not isinstance(stored, dict):
        return None
    cfg, problems = Config(), []
    apply_layer(cfg, stored, "a run's stored config", problems)
    if problems:
        return None
    meta = stored.get("_meta")
    cfg.test = bool(meta.get("test")) if isinstance(meta, dict) else False
    return cfg


RUN_CONFIG_FILE = "config.json"        # train: the resolved config (Config.save_resolved)
SFT_CONFIG_FILE = "sft_config.json"    # sft train: base checkpoint, data, hyperparameters, config
POST_TRAINING = ("sft", "dpo", "rl")   # run kinds that start from another run (or an imported model)


def _read_json_object(path: Path) -> Optional[dict]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def read_sft_config(run_dir) -> Optional[dict]:
    """An SFT run folder's ``sft_config.json`` (None when missing or unreadable)."""
    return _read_json_object(Path(run_dir) / SFT_CONFIG_FILE)


def stage_config_file(kind: str) -> str:
    """The file a post-training run keeps of what it was trained from and with."""
    return f"{kind}_config.json"


def run_kind(run_dir) -> str:
    """"pretrain" or the post-training kind of a run folder: the kind whose stage config file
    (``<kind>_config.json``) it holds, else the kind its name starts with (``<kind>_...``, the
    folder name the stages give; a run whose stage config is missing)."""
    d = Path(run_dir)
    for kind in POST_TRAINING:
        if (d / stage_config_file(kind)).is_file():
            return kind
    return next((k for k in POST_TRAINING if d.name.startswith(k + "_")), "pretrain")


def read_stage_config(run_dir) -> Optional[dict]:
    """A post-training run's ``<kind>_config.json`` (None for a pretraining run, or when
    missing or unreadable)."""
    kind = run_kind(run_dir)
    return _read_json_object(Path(run_dir) / stage_config_file(kind)) if kind != "pretrain" else None


def base_record(path, imported: bool = False) -> dict:
    """How a post-training run names what it starts from, so that the link survives moving or
    copying the project folder: the base run's folder name and the checkpoint file (a
    checkpoint of ours), and the path as given (for people; absolute paths go stale when the
    folder moves). An imported model (a Hugging Face folder, a .gguf file) is no run: its
    path alone."""
    p = Path(path)
    if imported:
        return {"run": None, "file": None, "path": str(p), "imported": True}
    return {"run": p.parent.name, "file": p.name, "path": str(p), "imported": False}


def base_run_name(stage_config: Optional[dict]) -> Optional[str]:
    """The run a post-training run starts from, by folder name: its ``base`` record, else (a
    record from before it) the folder of its ``base_checkpoint`` path; None for an imported
    model or an unreadable record."""
    sc = stage_config if isinstance(stage_config, dict) else {}
    base = sc.get("base")
    if isinstance(base, dict):
        run = base.get("run")
        return run if isinstance(run, str) and run else None
    path = sc.get("base_checkpoint")
    if isinstance(path, str) and path.endswith(".pt"):
        return Path(path).parent.name or None
    return None


def runs_started_from(checkpoints_dir, run_dir) -> list[RunInfo]:
    """The post-training runs (SFT, DPO, RL) whose base is a checkpoint of ``run_dir``, matched
    by the run's folder name (valid after the project folder moved), by name."""
    name = Path(run_dir).name
    out = [r for r in list_runs(checkpoints_dir)
           if r.kind in POST_TRAINING and base_run_name(read_stage_config(r.path)) == name]
    return sorted(out, key=lambda r: r.name)


def lineage(checkpoints_dir, run_dir) -> list[str]:
    """The chain of runs that ends with ``run_dir``: ``[first base, ..., run]`` by folder name
    (a pre-training run, an SFT run, a DPO run, ...). It stops at an imported model (the stage
    config says so: ``"(imported) PATH"`` starts the chain), at a base that is not under
    ``checkpoints_dir`` any more, and at a loop."""
    chain = [Path(run_dir).name]
    here = Path(run_dir)
    while len(chain) < 64:
        sc = read_stage_config(here)
        if sc is None:
            break
        base = sc.get("base") if isinstance(sc.get("base"), dict) else {}
        up = base_run_name(sc)
        if up is None:
            if base.get("imported") and isinstance(base.get("path"), str):
                chain.insert(0, f"(imported) {base['path']}")
            break
        if up in chain or not (Path(checkpoints_dir) / up).is_dir():
            chain.insert(0, up)
            break
        chain.insert(0, up)
        here = Path(checkpoints_dir) / up
    return chain


def stored_config(run_dir) -> Optional[Config]:
    """The config a run folder keeps: ``config.json`` (a pre-training run), else the
    ``config`` of its stage config (``sft_config.json`` of an SFT run, ...); None when neither is readable and valid."""
    cfg = _config_from(_read_json_object(Path(run_dir) / RUN_CONFIG_FILE))
    if cfg is None:
        cfg = _config_from((read_stage_config(run_dir) or {}).get("config"))
    return cfg




RUN_TOKENIZER_DIR = "tokenizer"      # the copy of its tokenizer each run folder keeps


def save_run_tokenizer(run_dir: Path, tok, name: str) -> Path:
    """Keep a copy of ``tok`` in the run folder (``<run>/tokenizer/``), so the folder works
    on another machine; an existing copy with the same fingerprint is left as it is."""
    from utils.data.tok import INFO_FILE, fingerprint, save_tokenizer     # (see the imports)
    target = Path(run_dir) / RUN_TOKENIZER_DIR
    info = target / INFO_FILE
    fp = fingerprint(tok)
    if info.is_file():
        try:
            held = json.loads(info.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            held = None           # a damaged copy: written again below
        if isinstance(held, dict) and held.get("fingerprint") == fp:
            return target
    save_tokenizer(tok, target, name, {"kind": "the run's tokenizer"})
    return target


def _candidates(ckpt: dict, cfg: Config, path: Optional[Path] = None) -> list[tuple[str, str, Config]]:
    """(label, tokenizer spec, config to resolve it against), in the order they are tried,
    without repeats."""
    from utils.data.tok import tokenizer_source                  # (see the imports)
    out: list[tuple[str, str, Config]] = []
    run_cfg = run_config(ckpt)
    if run_cfg is not None:
        out.append(("the run's config", tokenizer_source(run_cfg)[0], run_cfg))
    name = (ckpt.get("tokenizer") or {}).get("name")
    if isinstance(name, str) and name:
        out.append(("the checkpoint's tokenizer record", name, run_cfg or cfg))
    if path is not None and (Path(path).parent / RUN_TOKENIZER_DIR).is_dir():
        out.append(("the run folder's copy", str((Path(path).parent / RUN_TOKENIZER_DIR).resolve()), cfg))
    out.append(("the configured tokenizer.name", tokenizer_source(cfg)[0], cfg))
    seen, unique = set(), []
    for label, spec, base in out:
        key = str(base.resolve(spec)) if _is_path(spec, base) else spec
        if key not in seen:
            seen.add(key)
            unique.append((label, spec, base))
    return unique


def _is_path(spec: str, base: Config) -> bool:
    from utils.data.tok import looks_like_path                   # (see the imports)
    return looks_like_path(spec) or base.resolve(spec).exists()


def tokenizer_for_checkpoint(ckpt: dict, cfg: Config, path: Path,
                             say: Callable[[str], None] = print,
                             cache: Optional[dict] = None):
    """``(tokenizer, info)`` for the checkpoint at ``path`` (see the module docstring);
    ``info`` is the checkpoint's tokenizer record with ``fingerprint`` and ``verified``."""
    from utils.data.tok import fingerprint, load_tokenizer_from  # (see the imports)
    info = dict(ckpt.get("tokenizer") or {})
    want = info.get("fingerprint")
    cache = {} if cache is None else cache
    tried = []
    for label, spec, base in _candidates(ckpt, cfg, path):
        where = str(base.resolve(spec)) if _is_path(spec, base) else spec
        try:
            if where not in cache:
                tok = load_tokenizer_from(spec, base)
                cache[where] = (tok, fingerprint(tok))
        except PipelineError as e:
            first = str(e).splitlines()[0]
            first = (first[:200] + " (...)") if len(first) > 200 else first.rstrip(".")   # joined by "; "
            tried.append(f"{label} ({where}): {first}")
            continue
        tok, fp = cache[where]
        if want is None or fp == want:
            if label == "the configured tokenizer.name" and tried:
                say(f"note: {path} opens with the configured tokenizer {where} (same fingerprint "
                    "as the checkpoint's).")
            elif label != "the configured tokenizer.name" and cfg.tokenizer.name != info.get("name"):
                say(f"note: {path} was trained with tokenizer {where}; using it (the configuration "
                    f"names '{cfg.tokenizer.name}').")
            return tok, {**info, "fingerprint": fp, "verified": want is not None}
        tried.append(f"{label} ({where}): fingerprint {fp[:12]} differs")
    raise PipelineError(
        f"{path}: cannot find the tokenizer this checkpoint was trained with (name "
        f"{info.get('name')!r}, fingerprint {str(want)[:12]}...). Looked at: " + "; ".join(tried)
        + ". Put that tokenizer back (re-run `python main.py tokenize` with the run's config), "
        "or pass --config with tokenizer.name set to a tokenizer with this fingerprint.")
