"""How much visible text the wikitext renderer loses where templates were, before and after.

    python perf/wikitext_gaps.py [--before 9bf0f2b] [--dump data/samples/enwiki]

Runs the `clean` stage twice on the sample dump (gensim's real enwiki sample, 106 articles):
once as it was at git revision --before (checked out into a temporary worktree, run with this
venv's Python) and once as it is now, then measures both outputs the same way:

1. Templates that carry visible text (val, convert, nihongo, lang, transl, chem, script,
   nowrap, small, sic, IPA-like pronunciations and the column-list wrappers): for each one in
   the dump, a probe is taken from its arguments (the number of {{val}}/{{convert}}, the first
   words of the text argument, each item of a column list), and the probe is looked for in the
   cleaned text. Templates inside another template (an infobox) or a tag (<ref>), or in a
   section the cleaner drops ("See also", "References", ...) are left out: their container
   is dropped by design. Reported: probes found / probes, per template family.
2. Sentences with a gap where markup was: an empty parenthesis "()" or "( )", a parenthesis
   opening onto punctuation "(, " / "(; ", a doubled space, or a space before , ; or . that is
   not in the source text itself (the author's own "possesses ." is not a gap). Reported: the
   share of sentences with at least one such signature.

The probe check is a lower bound on what is kept (a probe can be rendered differently, e.g.
a unit spelled out), and the signatures are the tell-tale gaps the issue names; neither is a
full diff, so the script also prints a few examples of each kind from the "before" output.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = {
    "val": ("val",), "convert": ("convert", "cvt"),
    "nihongo": ("nihongo",), "lang": ("lang", "transl", "transliteration"),
    "chem": ("chem", "chem2"), "script": ("script",),
    "nowrap/small/sic": ("nowrap", "small", "sic"),
    "pronunciation": ("ipa", "ipac-en", "ipa-en", "ipa-all", "pronunciation"),
    "column lists": ("columns-list", "div col", "columns", "colbegin", "col-begin", "cols"),
}
GAPS = {
    "empty parenthesis": re.compile(r"\(\s*\)"),
    "parenthesis onto punctuation": re.compile(r"\(\s*[,;:.]"),
    "doubled space": re.compile(r"\S  +\S"),
    "space before punctuation": re.compile(r"\w \s*[,;](?=\s)|\w \.(?:\s|$)"),
}


def family_of(name: str):
    n = name.strip().lower().replace("_", " ")
    for fam, names in FAMILIES.items():
        if n in names or (fam == "pronunciation" and n.startswith("ipa")):
            return fam
    return None


def _plain(code) -> str:
    import mwparserfromhell
    return " ".join(mwparserfromhell.parse(str(code)).strip_code().replace("'''", "").replace("''", "").split())


def probes(tpl) -> list[str]:
    """Strings that the visible text of this template must contain."""
    fam = family_of(str(tpl.name))
    pos = [p for p in tpl.params if not p.showkey]
    if fam in ("val", "convert"):
        return [_plain(pos[0].value)] if pos and _plain(pos[0].value) else []
    if fam == "column lists":
        text = "\n".join(str(p.value) for p in tpl.params if not p.showkey or str(p.name).strip() in ("1", "content"))
        items = [_plain(l.lstrip("*#: ")) for l in text.splitlines() if l.strip().startswith(("*", "#"))]
        return [" ".join(i.split()[:3]) for i in items if i]
    if fam == "lang" and len(pos) >= 2:
        val = _plain(pos[1].value)
    elif fam == "pronunciation":
        return []                         # rendered as a respelling; no literal probe
    else:
        val = _plain(pos[0].value) if pos else ""
    return [" ".join(val.split()[:3])] if val else []


def dump_probes(dump_dir: Path) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """({article title: [(family, probe), ...]}, all wikitext whitespace-normalized)."""
    import mwparserfromhell
    from mwparserfromhell.nodes import Tag, Template
    from utils.data import mediawiki
    from utils.config import CleaningConfig
    from utils.data.wikitext import SectionMatcher
    dropped = SectionMatcher(CleaningConfig().drop_sections)
    out: dict[str, list] = {}
    raw: list[str] = []
    for path in sorted(dump_dir.glob("*.xml*")):
        with mediawiki.open_binary(path) as f:
            for page in mediawiki.iter_xml_pages(f):
                if page.ns != 0 or page.redirect or not page.text:
                    continue
                found = []
                code = mwparserfromhell.parse(page.text)
                # Sections the cleaner drops by design ("See also", "References", ...).
                for section in code.get_sections(flat=True, include_lead=True):
                    heads = section.filter_headings(recursive=False)
                    if heads and dropped(str(heads[0].title)):
                        continue
                    for tpl in section.filter_templates(recursive=True):
                        fam = family_of(str(tpl.name))
                        # Only templates in running text: inside another template (an
                        # infobox), a <ref> or another tag, the container is dropped by design.
                        if fam and not any(isinstance(a, (Template, Tag))
                                           for a in section.get_ancestors(tpl)):
                            found += [(fam, p) for p in probes(tpl)]
                out[page.title] = found
                raw.append(page.text)
    return out, " ".join(" ".join(raw).split())


def run_clean(cwd: Path, dump_dir: Path, out_dir: Path) -> str:
    """The clean stage of the checkout at cwd, on dump_dir; returns all cleaned text."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", LLM_PIPELINE_BASE_CONFIG="none")
    cmd = [sys.executable, "main.py", "clean", "--input-dir", str(dump_dir), "--output-dir",
           str(out_dir), "--force", "--workers", "1"]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"clean failed in {cwd} (exit {p.returncode}):\n{p.stderr[-2000:]}")
    from utils.data.textio import unescape_article
    return "\n".join(unescape_article(l) for f in sorted(out_dir.glob("cleaned_*.txt"))
                     for l in f.read_text(encoding="utf-8").splitlines())


def norm(s: str) -> str:
    return " ".join(s.replace("\u00a0", " ").split()).lower()


def measure(text: str, probe_map: dict, raw: str) -> tuple[dict, dict, list]:
    body = norm(text)
    per: dict[str, list[int]] = {}
    for items in probe_map.values():
        for fam, probe in items:
            hit = per.setdefault(fam, [0, 0])
            hit[1] += 1
            hit[0] += norm(probe) in body
    sentences = [s for line in text.splitlines() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", line) if len(s) > 20]
    gap_counts: Counter = Counter()
    examples = []
    with_gap = 0
    for s in sentences:
        # A signature that is in the source text itself ("possesses ." in Aristotle) is the
        # author's text, kept on purpose: only signatures the conversion made count.
        kinds = [k for k, rx in GAPS.items()
                 if any(" ".join(s[max(0, m.start() - 6):m.end() + 6].split()) not in raw
                        for m in rx.finditer(s))]
        gap_counts.update(kinds)
        if kinds:
            with_gap += 1
            if len(examples) < 6:
                examples.append((kinds[0], s[:140]))
    return per, {"sentences": len(sentences), "with_gap": with_gap, **gap_counts}, examples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="9bf0f2b", help="git revision of the renderer to compare with")
    ap.add_argument("--dump", type=Path, default=ROOT / "data/samples/enwiki")
    a = ap.parse_args()
    if not any(a.dump.glob("*.xml*")):
        sys.exit(f"no dump in {a.dump}: run `python main.py samples` first")
    probe_map, raw = dump_probes(a.dump)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tmp / "before"), a.before],
                       cwd=ROOT, check=True)
        try:
            results = {"before": measure(run_clean(tmp / "before", a.dump.resolve(), tmp / "out_before"), probe_map, raw),
                       "after": measure(run_clean(ROOT, a.dump.resolve(), tmp / "out_after"), probe_map, raw)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "before")], cwd=ROOT)
    print(f"wikitext gaps on {a.dump} ({len(probe_map)} articles); before = {a.before}, after = working tree")
    print(f"machine: {platform.node()} {platform.machine()}, Python {platform.python_version()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print("\n1. text-carrying templates: probes found in the cleaned text / probes")
    fams = sorted(set(results["before"][0]) | set(results["after"][0]))
    for fam in fams:
        b, af = results["before"][0].get(fam, [0, 0]), results["after"][0].get(fam, [0, 0])
        print(f"  {fam:22s} before {b[0]:4d}/{b[1]:<4d} ({100*b[0]/max(b[1],1):5.1f}%)   "
              f"after {af[0]:4d}/{af[1]:<4d} ({100*af[0]/max(af[1],1):5.1f}%)")
    tb = [sum(v[i] for v in results[k][0].values()) for k in ("before", "after") for i in (0, 1)]
    print(f"  {'all':22s} before {tb[0]:4d}/{tb[1]:<4d} ({100*tb[0]/max(tb[1],1):5.1f}%)   "
          f"after {tb[2]:4d}/{tb[3]:<4d} ({100*tb[2]/max(tb[3],1):5.1f}%)")
    print("\n2. sentences with a gap signature")
    for k in ("before", "after"):
        g = results[k][1]
        kinds = ", ".join(f"{n} {g.get(n, 0)}" for n in GAPS)
        print(f"  {k:6s} {g['with_gap']:5d} of {g['sentences']} sentences "
              f"({100*g['with_gap']/max(g['sentences'],1):.2f}%): {kinds}")
    for k in ("before", "after"):
        print(f"\n  examples ({k}):")
        for kind, s in results[k][2]:
            print(f"    [{kind}] {s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
