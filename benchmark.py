"""Stage `benchmark`: score checkpoints (and Hugging Face models) as lm-evaluation-harness does.

    python main.py benchmark                               # newest pretrain and SFT runs
    python main.py benchmark checkpoints/run_a/checkpoint_best.pt sft_run_b --preset standard
    python main.py benchmark --hf-model path/to/hf_folder --limit hellaswag=200 --per-item
    python main.py benchmark RUN --tasks lambada,hellaswag --preset full
    python main.py benchmark RUN_A RUN_B --preset core --contamination   # CORE-style score, overlap
    python main.py benchmark RUN --tasks mmlu,piqa --num-fewshot 5 --source piqa=data/piqa.jsonl

Models: checkpoint files, run folders or run names under ``paths.checkpoints_dir`` (a run
gives its checkpoint_best.pt, else checkpoint_latest.pt), and ``--hf-model`` Hugging Face
causal LMs (a save_pretrained folder, a .gguf file, or a hub name when online). With none
given, the newest pre-training run and the newest SFT run are compared.

Tasks, metrics, presets and the file formats: docs/benchmark.md. The library is
:mod:`utils.bench`; this script only parses arguments and orchestrates. Results go to
``paths.benchmark_dir/benchmark_<time>.json`` and ``.txt`` (``_items.jsonl`` with
``--per-item``). Exit codes: 0 ok, 1 failure (bad checkpoint, unreadable data), 2 usage or
configuration error, 130 Ctrl-C (nothing partial is written).
"""
from __future__ import annotations

import difflib
import importlib.util
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from utils.bench import core as CORE
from utils.bench import tasks as T
from utils.cli import PipelineError, StageParser, UsageError, cli_nonblank, cli_path, run_stage
from utils.config import Config
from utils.run import is_hf_model, list_runs, pick_checkpoint

# bench's adapters, runner and report import torch (1-2 s), its data and passkey modules numpy
# and the data readers (~0.2 s): they are imported in the steps that use them, so --help and the
# refusals before the models load do not wait for them.

# Items per task for each preset (the seed's quick / standard / comprehensive sizes for
# perplexity, LAMBADA and HellaSwag; ARC follows HellaSwag; None = the whole set). passkey:
# samples per cell of its grid (synthetic, no whole set: None takes PASSKEY_FULL).
# The further lm-eval tasks read from datasets (docs/benchmark.md) take HellaSwag's counts.
DATASET_TASKS = ("piqa", "winogrande", "boolq", "copa", "openbookqa", "commonsense_qa",
                 "social_iqa", "mmlu", "mmlu_cloze", "arithmetic", "triviaqa", "nq_open")
PRESETS: dict[str, dict[str, Optional[int]]] = {
    "quick": {"perplexity": 50, "lambada": 20, "hellaswag": 10, "arc_easy": 10,
              "arc_challenge": 10, "completion": 10, "passkey": 3,
              **{t: 10 for t in DATASET_TASKS}},
    "standard": {"perplexity": 100, "lambada": 50, "hellaswag": 20, "arc_easy": 20,
                 "arc_challenge": 20, "completion": 20, "passkey": 5,
                 **{t: 20 for t in DATASET_TASKS}},
    "comprehensive": {"perplexity": 200, "lambada": 100, "hellaswag": 50, "arc_easy": 50,
                      "arc_challenge": 50, "completion": 50, "passkey": 10,
                      **{t: 50 for t in DATASET_TASKS}},
    "full": {t: None for t in ("perplexity", "lambada", "hellaswag", "arc_easy",
                               "arc_challenge", "completion", "passkey", *DATASET_TASKS)},
}
# Presets that name their tasks and shots (whole sets): SmolLM2's model card (its base models'
# table: zero-shot; GSM8K, 5-shot there, has no data here) and the CORE tasks we have data for.
SMOLLM2_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "piqa", "mmlu_cloze", "commonsense_qa",
                 "triviaqa", "winogrande", "openbookqa")
TASK_PRESETS: dict[str, list[tuple[str, int]]] = {
    "smollm2": [(t, 0) for t in SMOLLM2_TASKS],
    "core": CORE.entries(),
}
PASSKEY_FULL = 20
TEST_CAP = 6          # --test: at most this many items per task
# --test: passkey's quick grid (the configured lengths and depths are for real runs)
PASSKEY_TEST = {"lengths": (128, 256), "depths": (0, 50, 100), "samples": 1}
TASKS = ("perplexity", "next_token", "lambada", "hellaswag", "arc_easy", "arc_challenge",
         "completion", "passkey", *DATASET_TASKS)
# Tasks that take solved examples (--num-fewshot); the others are scored as they are.
FEWSHOT_TASKS = ("hellaswag", "arc_easy", "arc_challenge", *DATASET_TASKS)


def build_parser() -> StageParser:
    p = StageParser("main.py benchmark", (__doc__ or "benchmark").strip().splitlines()[0],
                  test=f"quick mode: at most {TEST_CAP} items per task and a small passkey grid")   # -OO: no docstrings
    p.add_argument("models", nargs="*", metavar="CHECKPOINT", type=cli_nonblank,
                   help="checkpoint files, run folders or run names (default: newest pretrain "
                        "and SFT runs)")
    p.add_argument("--hf-model", action="append", default=[], metavar="DIR|FILE|NAME",
                   type=cli_nonblank,
                   help="a Hugging Face causal LM: save_pretrained folder, .gguf file, or hub "
                        "name (online); repeatable")
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="GGUF file name inside an --hf-model folder")
    p.config_flag("--preset", key="benchmark.preset",
                  choices=["quick", "standard", "comprehensive", "full", "smollm2", "core"],
                  help="items per task; smollm2: SmolLM2's model-card tasks, core: the CORE tasks "
                       "with data here and a CORE-style centered mean (both whole sets, their "
                       "own task lists)")
    p.config_flag("--tasks", key="benchmark.tasks", type=_task_list, metavar="T1,T2",
                  help=f"comma-separated tasks ({', '.join(TASKS)})")
    p.config_flag("--num-fewshot", key="benchmark.num_fewshot", type=int, metavar="N",
                  help="solved examples before each item (default: lm-eval's, 0); not with "
                       "--preset core, whose tasks have CORE's shot counts")
    p.add_argument("--source", action="append", default=[], metavar="TASK=SRC", type=cli_nonblank,
                   help="where a task's data comes from: a hub name (name:config) or a local "
                        "folder or file (repeatable; adds to benchmark.sources)")
    p.add_argument("--contamination", action="store_true",
                   help="also measure, per task, the share of items whose 13-grams lie in the "
                        "checkpoint's training shards (docs/benchmark.md)")
    p.add_argument("--limit", action="append", default=[], metavar="TASK=N",
                   help="items for one task (overrides the preset; N=all for the whole set)")
    p.config_flag("--seed", key="benchmark.seed", type=int, metavar="N",
                  help="seed of the fixed item selection")
    p.config_flag("--batch-size", key="benchmark.batch_size", type=int, metavar="N",
                  help="sequences per forward pass")
    p.config_flag("--device", key="benchmark.device", metavar="DEV", help="auto, cpu, cuda, cuda:N")
    p.config_flag("--dtype", key="benchmark.dtype", choices=["auto", "fp32", "bf16", "fp16"],
                  help="autocast dtype")
    p.config_flag("--perplexity-source", key="benchmark.perplexity_source", metavar="SRC",
                  help="WikiText hub name or local text/dump for perplexity")
    p.add_argument("--quantize", choices=["none", "int8"], default="none",
                   help="weights of our checkpoints and imported models (int8: weight-only, "
                        "utils/quant.py); not for --hf-model")
    p.add_argument("--per-item", action="store_true",
                   help="also write every item's scores (benchmark_<time>_items.jsonl)")
    p.add_argument("--output-dir", type=cli_path, default=None, metavar="DIR",
                   help="where results go (default: paths.benchmark_dir)")
    p.add_argument("--no-color", action="store_true", help="no colour in the table")
    return p


def _task_list(text: str) -> list:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    return tasks


def parse_sources(specs: Sequence[str]) -> dict[str, str]:
    """``TASK=SOURCE`` strings (benchmark.sources, then --source) -> {task: source}."""
    out: dict[str, str] = {}
    for spec in specs:
        task, sep, src = spec.partition("=")
        task = task.strip()
        if not sep or task not in DATA_SOURCES or not src.strip():
            raise UsageError(f"--source {spec!r}: expected TASK=SOURCE with TASK one of "
                             f"{', '.join(DATA_SOURCES)} and SOURCE a hub name or a local "
                             "folder or file.")
        out[task] = src.strip()
    return out


DATA_SOURCES = ("lambada", "hellaswag", "arc_easy", "arc_challenge", *DATASET_TASKS)


def parse_limits(specs: Sequence[str]) -> dict[str, Optional[int]]:
    out: dict[str, Optional[int]] = {}
    for spec in specs:
        task, sep, n = spec.partition("=")
        task = task.strip()
        if not sep or task not in TASKS or task == "next_token":
            valid = ", ".join(t for t in TASKS if t != "next_token")
            raise UsageError(f"--limit {spec!r}: expected TASK=N with TASK one of {valid} "
                             "(next_token uses the perplexity passages).")
        if n.strip().lower() in ("all", "full", "none"):
            out[task] = None
            continue
        try:
            value = int(n)
        except ValueError:
            value = -1
        if value < 1:
            raise UsageError(f"--limit {spec!r}: N must be a positive integer or 'all'.")
        out[task] = value
    return out


def check_tasks(tasks: Sequence[str]) -> list[str]:
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        hints = [f"{t}" + (f" (did you mean '{m[0]}'?)" if (m := difflib.get_close_matches(t, TASKS, 1))
                           else "") for t in bad]
        raise UsageError(f"unknown task(s): {', '.join(hints) or '(none given)'}; tasks are "
                         f"{', '.join(TASKS)}.")
    return list(dict.fromkeys(tasks))


def resolve_checkpoints(specs: Sequence[str], cfg: Config) -> list[Path]:
    """Checkpoint files from files, run folders or run names; default: newest pretrain + SFT."""
    ckdir = cfg.path("paths.checkpoints_dir")
    out: list[Path] = []
    for spec in specs:
        p = Path(spec).expanduser()
        cands = [p, ckdir / spec] if not p.is_absolute() else [p]
        hit = next((c for c in cands if c.exists()), None)
        if hit is None:
            raise PipelineError(f"checkpoint or run '{spec}' not found (looked for {cands[0]} and "
                                f"{ckdir / spec}). `python main.py status` lists the runs.")
        out.append(hit.resolve() if is_hf_model(hit) else   # imported through our model
                   pick_checkpoint(hit).resolve())         # a run folder: best, else latest
    if specs:
        return out
    runs = list_runs(ckdir) if ckdir.exists() else []
    for kind in ("pretrain", "sft"):
        run = next((r for r in runs if r.kind == kind and (r.best or r.latest)), None)
        if run is not None:
            out.append((run.best or run.latest).resolve())
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, cfg = build_parser().parse(argv)
    tasks, limits = plan(args, cfg)
    ckpts = resolve_checkpoints(args.models, cfg)
    if not ckpts and not args.hf_model:
        raise PipelineError(f"nothing to benchmark: no checkpoints in {cfg.path('paths.checkpoints_dir')} "
                            "and no --hf-model. Train first (`python main.py train --test`) or pass "
                            "checkpoint paths.")
    from utils.bench import adapters                 # torch (see the imports)
    device = adapters.resolve_device(cfg.benchmark.device)
    b = cfg.benchmark
    print(f"Benchmark: preset {b.preset}{' (--test)' if cfg.test else ''}, tasks {', '.join(tasks)}, "
          f"device {device}, seed {b.seed}", flush=True)
    check_outputs(args, cfg)
    loaded, selected, raw = load_data(cfg, tasks, limits, args.source)
    specs = [("checkpoint", str(p)) for p in ckpts] + [("hf", s) for s in args.hf_model]
    models, records = score_models(cfg, args, specs, device, selected, loaded, raw)
    if b.preset == "core":
        for m in models:
            agg = CORE.core_score(m["results"])
            if agg is not None:
                m["results"]["core"] = {"metrics": {"core": {"value": agg["value"], "stderr": agg["stderr"]}},
                                        "tasks": agg["tasks"], "note": CORE.coverage_note(agg["included"])}
    write_report(cfg, args, tasks, limits, device, models, records, loaded)
    return 0


# --------------------------------------------------------------------------- steps of main
def task_key(task: str, shots: int) -> str:
    """A task's result key: its name, with ``:shots`` when it has solved examples."""
    return task if shots == 0 else f"{task}:{shots}"


def plan(args, cfg) -> tuple[list[str], dict]:
    """The task keys (checked; ``task:K`` with K solved examples), the items per task (preset,
    --test cap, --limit), and the packages the chosen tasks need."""
    b = cfg.benchmark
    if b.preset in TASK_PRESETS:
        if b.preset == "core" and b.num_fewshot is not None:
            raise UsageError("--num-fewshot does not go with --preset core: each CORE task has "
                             "its own shot count (docs/benchmark.md); leave it out.")
        entries = [(t, b.num_fewshot if b.num_fewshot is not None and t in FEWSHOT_TASKS else k)
                   for t, k in TASK_PRESETS[b.preset]]
        limits = {t: None for t, _ in entries}
    else:
        shots = b.num_fewshot or 0
        entries = [(t, shots if t in FEWSHOT_TASKS else 0) for t in check_tasks(b.tasks)]
        limits = dict(PRESETS[b.preset])
    tasks = [task_key(t, k) for t, k in entries]
    if cfg.test:
        limits = {t: (TEST_CAP if n is None else min(n, TEST_CAP)) for t, n in limits.items()}
        limits["passkey"] = PASSKEY_TEST["samples"]
    limits.update(parse_limits(args.limit))
    limits = {**limits, **{key: limits.get(key.split(":")[0]) for key in tasks if ":" in key}}
    parse_sources([*b.sources, *args.source])      # refused now, not after the models load
    if args.gguf_file and not args.hf_model:
        raise UsageError("--gguf-file needs --hf-model (the folder holding the .gguf file).")
    if args.quantize != "none" and args.hf_model:
        raise UsageError("--quantize applies to our checkpoints and imported folders (pass the "
                         "folder as a positional CHECKPOINT), not to --hf-model (transformers).")
    if "completion" in tasks:
        missing = [m for m in ("sacrebleu", "rouge_score")
                   if importlib.util.find_spec(m) is None]
        if missing:
            raise PipelineError(f"the completion task needs the packages {', '.join(missing)} "
                                "(BLEU and ROUGE are computed by sacrebleu and rouge-score): "
                                "`pip install -r requirements.txt`, or leave the task out with "
                                "--tasks.")
    return tasks, limits


def output_dir(args, cfg) -> Path:
    return Path(args.output_dir) if args.output_dir else cfg.path("paths.benchmark_dir")


def check_outputs(args, cfg) -> None:
    """Before any model is scored (minutes): the result folder can be made, and each
    ``--hf-model`` given as a path exists and holds a model (config.json or a .gguf file); a
    hub name (``org/name``) is left to the loader. A bad one failed only after scoring, and
    the results were lost."""
    out = output_dir(args, cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot use {out} as the result folder ({e.strerror or e}): pass another "
                         "--output-dir (or paths.benchmark_dir).") from None
    for spec in args.hf_model:
        path = Path(spec).expanduser()
        hub_name = not path.is_absolute() and not spec.startswith((".", "~")) and spec.count("/") <= 1
        if not path.exists():
            if hub_name and not path.suffix == ".gguf":
                continue
            raise UsageError(f"--hf-model {spec}: no such file or folder.")
        if path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise UsageError(f"--hf-model {spec}: the folder holds no config.json and no .gguf file "
                             "(a save_pretrained folder, or a folder with a GGUF file).")


def load_data(cfg, tasks: list[str], limits: dict, cli_sources: Sequence[str] = ()) -> tuple[dict, dict, dict]:
    """Every task's data, loaded and validated once before any model is touched, the seeded
    selection of items as they are scored (with their shots) and as they are (for the
    contamination check), by task key; one line per task."""
    from utils.bench import data as D                # numpy (see the imports)
    b, root, samples_dir = cfg.benchmark, cfg.root, cfg.path("paths.samples_dir")
    loaded: dict = {}
    sources = {"lambada": b.lambada_source, "hellaswag": b.hellaswag_source,
               "arc_easy": b.arc_easy_source, "arc_challenge": b.arc_challenge_source,
               **{t: None for t in DATASET_TASKS}}
    sources.update(parse_sources([*b.sources, *cli_sources]))
    if {"perplexity", "next_token", "completion"} & set(tasks):
        texts = D.load_texts(b.perplexity_source, samples_dir, cfg.path("paths.cache_dir"), root)
        for t in ("perplexity", "next_token", "completion"):
            loaded[t] = texts
    most_shots: dict[str, int] = {}
    for key in tasks:
        t, _, k = key.partition(":")
        most_shots[t] = max(most_shots.get(t, 0), int(k or 0))
    for t, k in most_shots.items():
        if t in sources:
            loaded[t] = D.load_task(t, sources[t], samples_dir, root, fewshot=k)
    selected: dict = {}
    raw: dict = {}                 # the selected items without shots (the contamination check)
    shown_notes: set = set()
    for key in tasks:
        t, _, k = key.partition(":")
        if t in sources:
            raw[key] = D.select(loaded[t].items, limits[key], b.seed)
            selected[key] = D.attach_shots(t, loaded[t], raw[key], int(k or 0))
            data = loaded[t]
            note = f" [{data.note}]" if data.note and data.note not in shown_notes else ""
            shown_notes.add(data.note)
            shots = f", {k}-shot ({data.pool_rule})" if k else ""
            print(f"  {key}: {len(selected[key])} of {len(data.items)} valid items{shots}"
                  f"{f' ({sum(data.skipped.values())} rows skipped)' if data.skipped else ''}"
                  f"{f' ({data.repaired} rows with lone surrogates, read as U+FFFD)' if data.repaired else ''}"
                  f"{note}", flush=True)
            continue
    for t in tasks:
        if t in selected:
            continue
        if t == "passkey":
            loaded[t] = passkey_data(cfg, limits[t])
            selected[t] = loaded[t].items
            print(f"  passkey: {selected[t][0].describe()}", flush=True)
            continue
        if t == "completion":
            loaded[t] = completion_data(loaded[t])
        data = loaded[t]
        selected[t] = D.select(data.items, limits["perplexity" if t == "next_token" else t], b.seed)
        raw[t] = selected[t]
        note = f" [{data.note}]" if data.note and data.note not in shown_notes else ""
        shown_notes.add(data.note)
        repaired = getattr(data, "repaired", 0)
        print(f"  {t}: {len(selected[t])} of {len(data.items)} valid items"
              f"{f' ({sum(data.skipped.values())} rows skipped)' if data.skipped else ''}"
              f"{f' ({repaired} rows with lone surrogates, read as U+FFFD)' if repaired else ''}"
              f"{note}", flush=True)
    return loaded, {k: selected[k] for k in tasks}, raw


def passkey_data(cfg, samples: Optional[int]):
    """The passkey grid to run (``benchmark.passkey_*``; --test: PASSKEY_TEST's small grid)."""
    from utils.bench import data as D, passkey as P  # numpy (see the imports)
    b = cfg.benchmark
    grid = PASSKEY_TEST if cfg.test else {"lengths": b.passkey_lengths, "depths": b.passkey_depths}
    plan = P.PasskeyPlan(tuple(grid["lengths"]), tuple(grid["depths"]), samples or PASSKEY_FULL,
                         b.passkey_digits, b.seed)
    return D.TaskData(task="passkey", items=[plan], source="synthetic (landmark-attention passkey "
                      "prompts, utils/bench/passkey.py)")


def completion_data(data):
    """The completion task's items (prompt + reference words) from the perplexity passages."""
    from utils.bench import data as D                # numpy (see the imports)
    comp = D.TaskData(task="completion", items=[], source=data.source, note=data.note)
    comp.skipped.update(data.skipped)
    for it in data.items:
        try:
            comp.items.append(T.completion_item(it))
        except T.BadRow as e:
            comp.skipped[e.reason] += 1
    if not comp.items:
        raise PipelineError(f"{data.source}: no passage is long enough for the completion "
                            f"task ({T.COMPLETION_PROMPT_WORDS}+{T.COMPLETION_REFERENCE_WORDS} words).")
    return comp


def contamination(cfg, ad, spec: str, raw: dict) -> dict:
    """The contamination check of one checkpoint (utils/bench/contamination.py): its training
    shards found through its run's data record, every task's selected items against them."""
    from tqdm import tqdm
    from utils.bench import contamination as C       # torch (see the imports)
    from utils.data.shards import load_shards, read_metadata
    b = cfg.benchmark
    rule = C.rule_text(b.contamination_ngram, b.contamination_threshold)
    where, how = C.training_shard_dir(Path(spec), cfg)
    if where is None or not where.is_dir():
        why = how if where is None else f"its training shards {where} are not there any more ({how})"
        print(f"  {ad.name}: contamination: not checked: {why}", flush=True)
        return {"checked": False, "why": why, "rule": rule}
    shards = load_shards(where, read_metadata(where))
    total = sum(len(a) for a in shards)
    tasks = {k: v for k, v in raw.items() if k != "passkey" and k != "next_token"}
    with tqdm(total=total, desc=f"{ad.name[:24]} contamination", unit="tok", unit_scale=True,
              file=sys.stderr, leave=False, dynamic_ncols=True, mininterval=0.5) as bar:
        found = C.check(tasks, ad.encode, shards, b.contamination_ngram, b.contamination_threshold,
                        bar.update)
    seen = found.pop("_tokens")
    for key, r in found.items():
        share = "n/a" if r["share"] is None else f"{100 * r['share']:.1f}%"
        print(f"  {ad.name}: contamination: {key}: {share} of {r['judged']} items "
              f"({r['contaminated']} contaminated, {r['touched']} with any {b.contamination_ngram}-gram, "
              f"{r['too_short']} too short)", flush=True)
    return {"checked": True, "shards": str(where), "found_through": how, "tokens": seen,
            "rule": rule, "ngram": b.contamination_ngram, "threshold": b.contamination_threshold,
            "tasks": found}


def score_models(cfg, args, specs, device, selected: dict, loaded: dict,
                 raw: Optional[dict] = None) -> tuple[list, list]:
    """Each model in turn (memory is released between them): results and per-item records."""
    from utils.bench import adapters, runner         # torch (see the imports)
    b = cfg.benchmark
    models, records_all = [], []
    names_seen: dict[str, int] = {}
    tokenizers: dict = {}          # loaded once for checkpoints that share one
    for kind, spec in specs:
        t0 = time.perf_counter()
        if kind == "checkpoint" and is_hf_model(Path(spec)):
            ad = adapters.ImportedAdapter(Path(spec), device, b.dtype)
        elif kind == "checkpoint":
            ad = adapters.CheckpointAdapter(Path(spec), cfg, device, b.dtype, tokenizers)
        else:
            ad = adapters.HFAdapter(spec, device, b.dtype, gguf_file=args.gguf_file)
        if args.quantize == "int8":
            print(f"Model {ad.name}: {ad.quantize_int8()}", flush=True)
        n = names_seen.get(ad.name, 0)
        names_seen[ad.name] = n + 1
        if n:
            ad.name = f"{ad.name}#{n + 1}"
        context = "unbounded (Infini-attention)" if ad.long_context else ad.max_length
        print(f"Model {ad.name}: {ad.identity.get('parameters', 0):,} parameters, context "
              f"{context}, BOS-prefixed contexts: {ad.add_bos}", flush=True)
        results, records = runner.run_all(ad, selected, loaded, b.batch_size)
        contam = None
        if getattr(args, "contamination", False):
            contam = (contamination(cfg, ad, spec, raw or selected)
                      if isinstance(ad, adapters.CheckpointAdapter) else
                      {"checked": False, "why": "not a checkpoint of this project: no record of "
                                                "its training data"})
        models.append({"name": ad.name, "identity": ad.identity, "results": results,
                       "add_bos": ad.add_bos, "max_length": ad.max_length,
                       "seconds": round(time.perf_counter() - t0, 2),
                       **({"contamination": contam} if contam is not None else {})})
        records_all += records
        del ad
    return models, records_all


def write_report(cfg, args, tasks, limits, device, models, records, loaded) -> None:
    """The comparison table on the terminal, and the result files (JSON, text, per-item)."""
    from utils.bench import report                   # torch (see the imports)
    b = cfg.benchmark
    table = report.render_table(models, color=report.use_color(sys.stdout) and not args.no_color)
    plain = report.render_table(models, color=False)
    out_dir = output_dir(args, cfg)
    paths = report.output_paths(Path(out_dir))
    heatmaps = passkey_heatmaps(models, paths["json"])
    counts = "\n\n".join(x for x in (report.render_core(models), report.render_contamination(models),
                                      report.render_passkey(models), report.render_counts(models)) if x)
    settings = {"preset": b.preset, "test": cfg.test, "tasks": tasks, "limits": limits,
                "seed": b.seed, "batch_size": b.batch_size, "device": str(device),
                "dtype": b.dtype, "per_item": args.per_item,
                "scoring": "lm-evaluation-harness 0.4 definitions (docs/benchmark.md)"}
    payload = {
        "format": "llm-pipeline-benchmark", "format_version": 1,
        "created": paths["json"].stem.removeprefix("benchmark_"),
        "settings": settings, "versions": report.package_versions(),
        "models": models, "ranking": report.ranking(models) if len(models) > 1 else None,
        "data": {t: {"source": d.source, "note": d.note, "rows": d.rows,
                     "valid": len(d.items), "skipped": dict(d.skipped),
                     "repaired": getattr(d, "repaired", 0)} for t, d in loaded.items()},
    }
    header = (f"Benchmark {payload['created']}  preset {b.preset}  seed {b.seed}  device {device}"
              f"  dtype {b.dtype}")
    written = heatmaps + report.write_results(paths, payload, f"{header}\n\n{plain}\n\n{counts}",
                                              records if args.per_item else None)
    print()
    print(table)
    print()
    print(counts)
    print("\nWrote " + ", ".join(str(p) for p in written))


def passkey_heatmaps(models: list, json_path: Path) -> list[Path]:
    """A heat map per model that ran passkey, next to the results (its path recorded in them)."""
    from utils.bench import report                   # torch (see the imports)
    out = []
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(models):
        r = m["results"].get("passkey")
        if r is None:
            continue
        slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in m["name"])[:60]
        path = json_path.with_name(f"{json_path.stem}_passkey_{i + 1}_{slug}.png")
        out.append(report.passkey_heatmap(r, f"passkey retrieval: {m['name']}", path))
        r["heatmap"] = str(path)
    return out


if __name__ == "__main__":
    run_stage(main)
