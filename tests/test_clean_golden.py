"""The clean stage's output on the offline enwiki sample, pinned byte for byte.

`python main.py clean` runs on the real sample dump (106 articles, 100 redirects) twice: with
the default configuration (2 workers) and with ``keep_headings`` and ``min_chars 0`` (1
worker, so every heading and short article is pinned too). Each output must equal the golden
in tests/data/clean_golden.json: the sha256 of the whole file, one short hash per article
(the failure names the articles that differ by their first words) and the run's totals
(articles kept, skip reasons, sections dropped, characters in and out).

A change to the cleaner's output is deliberate or a bug. When it is an improvement, regenerate
the golden with

    python tests/test_clean_golden.py --update

and say in the same commit what changed and why it is better.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import pytest

if __name__ == "__main__":                       # run as a script (--update): import the project
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import ENWIKI_XML, run_stage, write_config  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "clean_golden.json"
RUNS = {   # name -> (cleaning config, --workers)
    "default": ({}, 2),
    "keep_headings": ({"keep_headings": True, "min_chars": 0}, 1),
}
OUTPUT = "cleaned_enwiki-sample-pages-articles.txt"


def clean_sample(tmp: Path, name: str) -> dict:
    """Run `main.py clean` on the sample with RUNS[name]; the golden record of its output."""
    cleaning, workers = RUNS[name]
    (tmp / name).mkdir(parents=True)
    cfg = write_config(tmp / name, {"wikipedia": {"raw_dir": str(ENWIKI_XML.parent)},
                                    "cleaning": cleaning})
    out = tmp / name / "out"
    proc = run_stage("clean", "--config", cfg, "--workers", workers, "--output-dir", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = (out / OUTPUT).read_bytes()
    totals = json.loads((out / "cleaning_summary.json").read_text())["totals"]
    totals.pop("seconds")
    return {"sha256": hashlib.sha256(data).hexdigest(),
            "articles": [[hashlib.sha256(line).hexdigest()[:16], line.decode("utf-8")[:48]]
                         for line in data.splitlines()],
            "totals": totals}


@pytest.mark.parametrize("name", list(RUNS))
def test_clean_output_matches_golden(samples, tmp_path, name):
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))[name]
    got = clean_sample(tmp_path, name)
    if got["sha256"] != golden["sha256"]:
        want = {h for h, _ in golden["articles"]}
        have = {h for h, _ in got["articles"]}
        changed = [head for h, head in got["articles"] if h not in want]
        missing = [head for h, head in golden["articles"] if h not in have]
        pytest.fail(f"{name}: the cleaned sample differs from {GOLDEN.name} "
                    f"({len(got['articles'])} articles, golden {len(golden['articles'])}); "
                    f"{len(changed)} new or changed, e.g. {changed[:5]}; "
                    f"{len(missing)} golden articles not produced, e.g. {missing[:5]}. "
                    f"If the change is an improvement: python tests/test_clean_golden.py --update")
    assert got["totals"] == golden["totals"]


def update() -> None:
    """Regenerate tests/data/clean_golden.json from the current code."""
    with tempfile.TemporaryDirectory() as tmp:
        golden = {name: clean_sample(Path(tmp), name) for name in RUNS}
    GOLDEN.parent.mkdir(exist_ok=True)
    lines = []                                   # one article per line: readable diffs
    for name, g in golden.items():
        rows = ",\n".join("   " + json.dumps(a, ensure_ascii=False) for a in g["articles"])
        lines.append(f' {json.dumps(name)}: {{"sha256": {json.dumps(g["sha256"])},\n'
                     f'  "totals": {json.dumps(g["totals"], ensure_ascii=False)},\n'
                     f'  "articles": [\n{rows}]}}')
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    print(f"wrote {GOLDEN}: " + ", ".join(f"{n} {len(g['articles'])} articles" for n, g in golden.items()))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    update()
