"""The seams the code is built on (docs/DESIGN.md, the map): imports run one way, down; the
network, the generation engine, the run layer and checkpoint I/O each stay in their place;
library modules have no process-wide side effects. Read from the source with ``ast``, so
a change that crosses a seam fails here with the file and line."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

STAGES = {"main", "cleaner", "tokenizer", "dataset_prep", "fineweb_prep", "train", "status",
          "post_training", "dpo", "rl", "inference", "benchmark", "export", "serve", "report"}
LIBRARY = sorted((ROOT / "utils").rglob("*.py")) + [ROOT / "model.py", ROOT / "dataloader.py"]
# docs/DESIGN.md's layers, bottom first: a module imports from the layers below its own and
# from its own package of utils/; packages of one layer import nothing of each other.
LAYERS = (
    ("utils.errors", "utils.stdio", "utils.processes"),      # basics that import nothing of ours
    ("utils.disk",),
    ("utils.atomic",),
    ("utils.config",),
    ("utils.cli", "utils.environment"),
    ("utils.device", "utils.activations", "utils.attention", "utils.loss", "utils.infini",
     "utils.quant", "utils.lora"),                           # the device; the network's parts
    ("utils.data", "model", "utils.training"),               # text to tokens; the network; the loop
    ("dataloader", "utils.generation", "utils.hf"),
    ("utils.run",),
    ("utils.bench", "utils.stage", "utils.serve", "utils.rl"),
    ("utils.post_start",),                                   # the start of sft train, dpo train, rl
    ("utils.report",),
    tuple(sorted(STAGES)),
)
MAX_FUNCTION_LINES = 60


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import in the file, at any depth (lazy imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
    return out


def _calls(path: Path, names: set[str]) -> list[tuple[str, int]]:
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in names:
                hits.append((name, node.lineno))
    return hits


def test_no_library_module_imports_a_stage_script():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in LIBRARY
           for mod, line in _imports(p) if mod.split(".")[0] in STAGES]
    assert not bad, bad


def test_the_network_and_the_file_format_know_nothing_above_them():
    """model.py imports no generation, run, training or HF code; the engine and the modules
    beside it do not import model.py (they drive any model with the network's interface);
    checkpoint I/O does not import the model (the run layer builds it)."""
    model_imports = {m for m, _ in _imports(ROOT / "model.py")}
    assert not {m for m in model_imports if m.startswith(("utils.run", "utils.training",
                                                          "utils.hf", "utils.bench",
                                                          "utils.generation"))}, model_imports
    for path in (ROOT / "utils" / "generation").glob("*.py"):
        assert "model" not in {m for m, _ in _imports(path)}, path.name
    ckpt_imports = {m for m, _ in _imports(ROOT / "utils" / "training" / "checkpoint.py")}
    assert "model" not in ckpt_imports and not any(m.startswith("utils.run") for m in ckpt_imports)


def test_the_loss_is_a_module_of_its_own():
    """The fused linear + cross-entropy (an autograd Function) is utils/loss.py, which needs
    torch alone; model.py, the network, calls it and defines no autograd Function itself."""
    loss_imports = {m.split(".")[0] for m, _ in _imports(ROOT / "utils" / "loss.py")}
    assert loss_imports <= {"__future__", "typing", "torch"}, loss_imports
    assert "autograd.Function" not in (ROOT / "model.py").read_text()


def test_a_models_shape_is_checked_in_one_place():
    """utils.config.model_problems is the one check of a model's shape (config.json, its
    translation and ModelArgs run it): model.py words no problem of its own, and the names the
    config accepts are the ones the network implements."""
    src = (ROOT / "model.py").read_text()
    assert "model_problems(" in src and "must divide" not in src and "p.append(" not in src
    from utils import config, infini
    from utils.activations import GATE_ACTIVATIONS, HF_ACT_NAMES
    assert config.ACTIVATIONS == tuple(GATE_ACTIVATIONS) == tuple(HF_ACT_NAMES)
    assert config.INFINI_GATES == infini.GATES
    from model import ModelArgs, model_args_from_config

    def problems(make) -> list[str]:
        try:
            make()
        except config.ConfigError as e:
            return e.problems
        raise AssertionError("accepted")
    c = config.Config()
    c.model.document_mask = True                 # the same words from the translation and ModelArgs
    assert problems(lambda: model_args_from_config(c, 100, None)) == \
        problems(lambda: ModelArgs(vocab_size=100, document_mask=True))
    dropout = "model.dropout: 1.0 must be in [0, 1)"      # config.json's check is ModelArgs'
    assert problems(lambda: config.load_config(base_file=None, overrides={"model.dropout": 1.0}))[0] \
        .startswith(dropout + " [model.dropout from command-line flags]")
    assert problems(lambda: ModelArgs(vocab_size=100, dropout=1.0)) == [dropout]


def test_generation_lives_in_the_engine_only():
    """No generation loop outside utils/generation: model.py has no generate/sampling, and
    every caller goes through the engine."""
    src = (ROOT / "model.py").read_text()
    for name in ("def generate", "def generate_stream", "def sample_next", "def top_k_filter",
                 "class KVCache", "_decode_pack", "set_num_threads"):
        assert name not in src, name
    callers = [p for p in ROOT.glob("*.py")] + LIBRARY
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in callers
           if "generation" not in p.parts for name, line in _calls(p, {"generate_stream"})]
    assert not bad, bad


def test_no_process_side_effects_in_library_modules():
    """No exec of a process and no change of torch's global thread count outside the engine's
    step scope (utils/generation/threads.py); importing every library module leaves the
    environment, the thread count and the signal handlers as they were."""
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in LIBRARY
           for name, line in _calls(p, {"execve", "execv", "execvp", "system"})]
    assert not bad, bad
    threads = [f"{p.relative_to(ROOT)}:{line}" for p in LIBRARY
               for name, line in _calls(p, {"set_num_threads"})
               if p != ROOT / "utils" / "generation" / "threads.py"]
    assert not threads, threads
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in LIBRARY]
    code = ("import os, signal, sys, torch\n"
            "env, n = dict(os.environ), torch.get_num_threads()\n"
            "handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]\n"
            f"for m in {modules!r}:\n"
            "    __import__(m)\n"
            "assert dict(os.environ) == env, set(os.environ.items()) ^ set(env.items())\n"
            "assert torch.get_num_threads() == n\n"
            "assert handlers == [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]\n"
            "print('ok', len(sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stderr[-2000:]


def test_functions_read_as_short_steps():
    """No function in a stage script or the library is longer than 60 lines, nested ones
    included: a stage's main() is a short sequence of named steps over library code, and a
    library function longer than a screen is split by what its parts do."""
    long = []
    for path in [ROOT / f"{name}.py" for name in sorted(STAGES)] + LIBRARY:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _package(module: str) -> str:
    """What LAYERS places: a package of utils/ (``utils.data``), else the module itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "utils" and len(parts) > 2 else module


def _project_imports(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(project module, line) of every import in the file, lazy ones included: ``from utils
    import stage`` is utils.stage; a relative import is resolved against the file's package."""
    here = _module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found = set()
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != "utils":
                found.add(name)
        out += [(name, node.lineno) for name in sorted(found)]
    return out


def test_no_import_runs_up_between_packages():
    """Every import of a stage script or a library module, lazy ones included, runs down
    LAYERS (docs/DESIGN.md), or stays inside its own package of utils/; a module LAYERS does
    not place is named, to be placed."""
    files = [ROOT / f"{name}.py" for name in sorted(STAGES)] + LIBRARY
    modules = {_module_name(p) for p in files}
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    unplaced = sorted({_package(m) for m in modules} - set(layer) - {"utils"})
    assert not unplaced, f"not in LAYERS: {unplaced}"
    bad = []
    for path in files:
        source = _package(_module_name(path))
        for module, line in sorted(_project_imports(path, modules), key=lambda m: m[1]):
            target = _package(module)
            if target == source or source == "utils" or layer[target] < layer[source]:
                continue
            how = "above" if layer[target] > layer[source] else "beside"
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}, {how} {source}")
    assert not bad, bad
