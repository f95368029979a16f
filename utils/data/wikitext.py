"""Wikitext and article text -> clean plain text (library; no side effects).

The `clean` stage (cleaner.py) reads dumps; this module turns what it read into the text a
model is trained on:

- :func:`render` turns MediaWiki wikitext into plain-text pieces plus :class:`HeadingMark`s,
  with mwparserfromhell. Links and formatting keep their visible text. Templates that carry
  visible text are rendered to it (:data:`TEMPLATES`: nihongo, lang / lang-xx, transl,
  script, val, convert, chem, nowrap, small, sic, IPA / IPAc-en / respell, quotes, dates,
  the list wrappers columns-list / columns / div col / flatlist / plainlist / hlist /
  unbulleted list, and small symbol templates); every other template (citations,
  infoboxes, hatnotes, navboxes ...) is dropped, like <ref>s, tables, files, categories,
  interlanguage links, comments and <math>. HTML entities are decoded exactly once
  (``&amp;nbsp;`` stays the literal text ``&nbsp;``, as on the wiki).
- Wherever markup is dropped, a sentinel :data:`MARK` (a Unicode noncharacter, stripped
  from the input first) is left in the text. :func:`clean_paragraph` tidies punctuation
  only next to a MARK: "Phoebus ({{unknown}}, Phoibos" -> "Phoebus (Phoibos", while text
  that was written that way ("call printf() to print; main() returns 0.") is never touched.
- :class:`SectionMatcher` decides which sections are dropped (References, Further reading,
  "Selected bibliography", "Notes and references" ...) by normalized words, not exact
  strings; :class:`ArticleBuilder` collects paragraphs and counts the titles dropped.
- :func:`sanitize` replaces lone surrogates (from JSON ``\\ud800`` escapes) with U+FFFD and
  removes control characters, counting both.

Costs (docs/performance.md, Cleaning XML dumps, has the measurements): what is dropped anyway is cut out before
parsing, as MediaWiki's preprocessor takes it out before its parser runs: <ref>s
(:func:`cut_references`), then templates that carry no text and tables
(:func:`cut_dropped_blocks`), found by brace and line matching that skips comments and tags
whose content is not wikitext; that is about half of an article's wikitext and of the
tokenizer's time. mwparserfromhell's C tokenizer then makes a flat token list, and
:func:`render_tokens` renders straight from it, building a node tree only for a template
that carries text (rendered by :func:`render_nodes`, the reference semantics; a token
sequence it does not model sends the whole article through the node tree). Building the
full tree was about 70% of the conversion; the token renderer makes exactly the pieces of
the node path (tested on the sample dump and on random broken markup). Nesting is bounded by
the parser's own limit; deeper structures that still exhaust Python's recursion limit raise
RecursionError, which callers treat as a bad input record.
"""
from __future__ import annotations

import html
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Optional

import mwparserfromhell
import mwparserfromhell.nodes as mw
from mwparserfromhell.parser import Builder, CTokenizer
from mwparserfromhell.parser import tokens as tk
from mwparserfromhell.parser.tokenizer import Tokenizer

from utils.data.textio import replace_surrogates

MARK = "\ufdd0"   # noncharacter: "markup was removed here"; never in input or output

# --------------------------------------------------------------------------- plain text
# C0/C1 controls that are not whitespace (whitespace ones collapse to a space), DEL,
# and the noncharacters U+FDD0-U+FDEF, U+FFFE, U+FFFF.
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\ufdd0-\ufdef\ufffe\uffff]")
_CONTROL_KEEP_MARK = re.compile(r"[\x00-\x08\x0e-\x1b\x7f-\x84\x86-\x9f\ufdd1-\ufdef\ufffe\uffff]")

# Punctuation tidy-up, applied only where a MARK shows that markup was removed.
_M = MARK
_TIDY = [
    # "( MARK )", "(MARK, MARK)": a parenthesis left empty by the removal
    (re.compile(rf" ?\((?=[^()]*{_M})[\s{_M},;:]*\)"), _M),
    # "(MARK, Phoibos" / "(MARK born" -> "(Phoibos" / "(born"
    (re.compile(rf"\(\s*{_M}[\s{_M}]*(?:[,;:]\s*)?"), "("),
    # "Akhilleus, MARK)" / "word MARK )" -> "Akhilleus)" / "word)"
    (re.compile(rf"(?:\s*[,;:])?[\s{_M}]*{_M}\s*\)"), ")"),
    # "word, MARK, more" / "word; MARK; more" -> "word, more"
    (re.compile(rf"([,;:])\s*{_M}[\s{_M}]*[,;:]"), r"\1"),
    # "text MARK." / "text MARK ," -> "text." (space left before punctuation by a removal)
    (re.compile(rf"\s*{_M}[\s{_M}]*([,.;:!?])"), r"\1"),
]
# a paragraph that starts with punctuation only because its start was removed (applied
# first: after "text MARK." -> "text." nothing of the kind is left to match)
_TIDY_START = (re.compile(rf"^[\s{_M}]*{_M}[\s{_M}]*[,.;:]+\s*"), "")
# Every tidy match is a run of whitespace, ",;:.!?()" and MARKs holding a MARK, so the
# patterns run on each such run alone (cached: a few hundred distinct runs make up a whole
# article), never over the paragraph's words: the same result at a fifth of the cost.
_TIDY_RUN = re.compile(rf"[\s,;:.!?(){_M}]*{_M}[\s,;:.!?(){_M}]*")


@lru_cache(maxsize=4096)
def _tidy_run(run: str, at_start: bool) -> str:
    for pattern, repl in (_TIDY_START, *_TIDY) if at_start else _TIDY:
        run = pattern.sub(repl, run)
    return run


def normalize_unicode(text: str, form: str) -> str:
    """Apply the configured normalization form ("NFC", "NFKC" or "none")."""
    return text if form == "none" else unicodedata.normalize(form, text)


def sanitize(text: str, repairs: Optional[Counter] = None, keep_mark: bool = False) -> str:
    """Replace lone surrogates with U+FFFD and remove control characters (and stray
    sentinels unless ``keep_mark``); what was changed is counted into ``repairs``."""
    text, n = replace_surrogates(text)
    if n and repairs is not None:
        repairs["lone surrogate replaced"] += n
    text, n = (_CONTROL_KEEP_MARK if keep_mark else _CONTROL).subn("", text)
    if n and repairs is not None:
        repairs["control character removed"] += n
    return text


def clean_paragraph(text: str, form: str = "NFC", repairs: Optional[Counter] = None) -> str:
    """One paragraph of (possibly MARKed) text -> clean text.

    Lone surrogates and control characters are repaired, Unicode normalized, runs of
    whitespace (newlines included) become one space, and punctuation left behind by
    removed markup is tidied at the MARKs only; the MARKs are then removed."""
    text = sanitize(text, repairs, keep_mark=True)
    text = " ".join(normalize_unicode(text, form).split())     # str.split: exactly \s
    if MARK in text:
        text = _TIDY_RUN.sub(lambda m: _tidy_run(m.group(0), m.start() == 0), text)
        text = " ".join(text.replace(MARK, " ").split())
    return text


# --------------------------------------------------------------------------- sections
# Words that only qualify a reference-like section title ("Selected bibliography",
# "Etymological bibliography", "Reference literature", "Primary sources"), and connectors.
QUALIFIER_WORDS = frozenset("""selected select further additional general other etymological
    primary secondary tertiary literature cited recommended suggested related list specific
    inline explanatory official online external print more""".split())
CONNECTOR_WORDS = frozenset("and or of the for with on in".split())


def _singular(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def title_words(title: str) -> tuple:
    """Normalized words of a section title: casefolded, punctuation removed, singular."""
    text = unicodedata.normalize("NFKC", str(title)).casefold().replace("&", " and ")
    return tuple(_singular(w) for w in re.findall(r"\w+", text))


def section_key(title: str) -> str:
    """Canonical form of a section title for display and exact matching."""
    return " ".join(str(title).split()).casefold()


class SectionMatcher:
    """Is a section title one of the configured reference-like sections?

    Each configured title of one word ("References", "Notes", "Bibliography") is a *core*
    word; a longer one ("External links", "See also", "Works cited") is a *phrase*. A
    title matches when its words, read left to right, are all core words, phrases, or
    qualifier/connector words (:data:`QUALIFIER_WORDS`, :data:`CONNECTOR_WORDS`), with at
    least one core word or phrase. So "Selected bibliography", "Reference literature",
    "Notes and references", "Further reading and external links" match; "Literature",
    "Selected works", "Notes on pronunciation" do not.
    """

    def __init__(self, titles: Iterable[str]):
        self.core: set = set()
        self.phrases: list[tuple] = []
        for t in titles:
            words = title_words(t)
            if len(words) == 1:
                self.core.add(words[0])
            elif words:
                self.phrases.append(words)
        self.phrases.sort(key=len, reverse=True)

    def __call__(self, title: str) -> bool:
        words = title_words(title)
        i, matched = 0, False
        while i < len(words):
            for phrase in self.phrases:
                if words[i:i + len(phrase)] == phrase:
                    i, matched = i + len(phrase), True
                    break
            else:
                w = words[i]
                if w in self.core:
                    matched = True
                elif w not in QUALIFIER_WORDS and w not in CONNECTOR_WORDS:
                    return False
                i += 1
        return matched


class ArticleBuilder:
    """Collects an article's paragraphs while tracking sections.

    ``heading(level, title)`` opens a section; a section whose title ``drop`` matches is
    dropped with everything under it until a heading of the same or a higher level (its
    title is counted in ``dropped``). With ``keep_headings`` a heading becomes a paragraph
    only once text follows it, so a section left empty by cleaning leaves no orphan title.
    """

    def __init__(self, drop: Callable[[str], bool], form: str = "NFC", keep_headings: bool = False):
        self.drop, self.form, self.keep_headings = drop, form, keep_headings
        self.paragraphs: list[str] = []
        self.dropped: Counter = Counter()    # section title -> times dropped
        self.repairs: Counter = Counter()    # what sanitize() changed
        self._drop_level: Optional[int] = None
        self._pending: list[tuple[int, str]] = []   # (level, title) headings awaiting text

    def heading(self, level: int, title: str, marked: bool = False) -> None:
        if not marked:
            title = title.replace(MARK, "")
        if self._drop_level is not None and level <= self._drop_level:
            self._drop_level = None
        if self._drop_level is not None:
            return
        title = clean_paragraph(title, self.form, self.repairs)
        if title and self.drop(title):
            self._drop_level = level
            self.dropped[title] += 1
            return
        self._pending = [(lv, t) for lv, t in self._pending if lv < level]
        if title:
            self._pending.append((level, title))

    def end_section(self, level: int) -> None:
        """Close a section (nested formats): ends a drop started at this level."""
        if self._drop_level is not None and level <= self._drop_level:
            self._drop_level = None
        self._pending = [(lv, t) for lv, t in self._pending if lv < level]

    @property
    def dropping(self) -> bool:
        return self._drop_level is not None

    def add_text(self, text: str, marked: bool = False) -> None:
        """Add raw text; blank lines split it into paragraphs, other whitespace collapses.
        ``marked``: the text carries MARKs from :func:`render` (else any are stripped)."""
        if self.dropping or not text:
            return
        if not marked:
            text = text.replace(MARK, "")
        for block in re.split(r"\n\s*\n", text):
            para = clean_paragraph(block, self.form, self.repairs)
            if para:
                if self.keep_headings:
                    self.paragraphs.extend(t for _, t in self._pending)
                self._pending = []
                self.paragraphs.append(para)

    def text(self) -> str:
        return "\n".join(self.paragraphs)


# --------------------------------------------------------------------------- entities
_ENTITY = re.compile(r"&(?:[A-Za-z][A-Za-z0-9]{1,31}|#[0-9]{1,8}|#[xX][0-9A-Fa-f]{1,7});")


def decode_entities(text: str) -> str:
    """Decode ``&name;`` / ``&#N;`` / ``&#xN;`` exactly once, as MediaWiki does (only with
    the semicolon; unknown names kept; invalid code points become U+FFFD or nothing).
    One pass: ``&amp;nbsp;`` becomes the text ``&nbsp;``, never a space."""
    if "&" not in text:
        return text
    return _ENTITY.sub(lambda m: html.unescape(m.group(0)), text)


# --------------------------------------------------------------------------- wikitext
DROP_TAGS = {"ref", "references", "table", "gallery", "math", "score", "timeline",
             "imagemap", "templatedata", "graph", "mapframe", "maplink", "syntaxhighlight",
             "source", "hiero", "inputbox", "categorytree", "noinclude", "includeonly",
             "indicator", "section", "langconvert"}
CHEM_TAGS = {"chem", "ce"}
BREAK_TAGS = {"p", "div", "hr", "blockquote", "li", "dd", "dt", "ul", "ol", "dl", "center"}
DROP_LINK_NAMESPACES = {"file", "image", "media", "category"}
_LANG_PREFIX = re.compile(r"^[a-z]{2,3}(?:-[a-z0-9]+)*$|^simple$")
_SIMPLE_CHEM = re.compile(r"^[A-Za-z0-9 ()\[\]+\-=<>.,·^_]*$")


@dataclass(frozen=True)
class HeadingMark:
    """A section heading met while rendering wikitext (see :func:`render`)."""
    level: int
    title: str


def template_name(raw_name: str) -> str:
    """Canonical template name: 'Template:Lang_fr ' -> 'lang fr'."""
    name = " ".join(raw_name.replace("_", " ").split()).lower()
    return name[9:].strip() if name.startswith("template:") else name


class _Args:
    """A template's parameters, rendered to text on demand."""

    def __init__(self, tpl):
        self.tpl = tpl
        self.positional = [p for p in tpl.params if not p.showkey]

    def get(self, key, default: str = "") -> str:
        key = str(key)
        if not self.tpl.has(key):
            return default
        return wikicode_text(self.tpl.get(key).value.nodes).strip()

    def raw(self, key, default: str = "") -> str:
        key = str(key)
        return str(self.tpl.get(key).value).strip() if self.tpl.has(key) else default

    def pos(self) -> list[str]:
        return [wikicode_text(p.value.nodes).strip() for p in self.positional]

    def block(self, key) -> str:
        """A parameter holding block content (list items, paragraphs): breaks kept."""
        key = str(key)
        return wikicode_text(self.tpl.get(key).value.nodes) if self.tpl.has(key) else ""


def _first(a: _Args) -> str:
    return a.get(1)


def _second(a: _Args) -> str:
    return a.get(2)


def _last_positional(a: _Args) -> str:
    pos = a.pos()
    return pos[-1] if pos else ""


def _last_block(a: _Args) -> str:
    """{{columns-list|2|* a\n* b}}: the list is the last positional parameter."""
    return _block(wikicode_text(a.positional[-1].value.nodes)) if a.positional else ""


def _block(s: str) -> str:
    return f"\n\n{s}\n\n" if s.strip() else ""


def _items(items: Iterable[str]) -> str:
    return "".join(_block(i) for i in items if i.strip())


MONTHS = ("January February March April May June July August September October "
          "November December").split()


def _date(a: _Args, start: int = 1) -> str:
    """{{birth date|1809|2|12|df=y}} -> 'February 12, 1809' (mdy) or '12 February 1809' (df)."""
    pos = [p for p in a.pos()]
    y, m, d = (pos[start - 1:start + 2] + ["", "", ""])[:3]
    try:
        month = MONTHS[int(m) - 1] if m else ""
    except (ValueError, IndexError):
        month = m
    day = d.lstrip("0")
    if not month:
        return y
    if not day:
        return f"{month} {y}".strip()
    dmy = a.raw("df").lower() in ("y", "yes", "1", "true")
    return f"{day} {month} {y}" if dmy else f"{month} {day}, {y}"


def _age(a: _Args) -> str:
    """{{death date and age|1865|4|15|1809|2|12}} -> 'April 15, 1865 (aged 56)'."""
    pos = a.pos()
    text = _date(a, 1)
    try:
        y1, m1, d1, y0, m0, d0 = (int(x or 1) for x in (pos + ["1"] * 6)[:6])
        age = y1 - y0 - ((m1, d1) < (m0, d0))
        return f"{text} (aged {age})"
    except ValueError:
        return text


def _birth_age(a: _Args) -> str:
    return _date(a, 1)


def _val(a: _Args) -> str:
    """{{val|6.241|e=18}} -> '6.241×10^18'; {{val|1.2|0.3}} -> '1.2 ± 0.3'; units u= / ul=."""
    pos = a.pos()
    if not pos:
        return ""
    text = a.get("p") + pos[0]
    if len(pos) >= 3:
        text += f" +{pos[1]} −{pos[2]}"
    elif len(pos) == 2:
        text += pos[1] if pos[1].startswith("(") else f" ± {pos[1]}"
    if a.get("e"):
        text += f"×10^{a.get('e')}"
    unit = a.get("u") or a.get("ul")
    per = a.get("up") or a.get("upl")
    if unit:
        text += f" {unit}"
    if per:
        text += f"/{per}"
    return text + a.get("s")


_RANGE_WORDS = {"-", "–", "to", "and", "or", "by", "x", "×", "+", "+/-", "±", "and(-)", "to(-)",
                "&", "or(-)", "to about"}


def _convert(a: _Args) -> str:
    """{{convert|1300|mi|km}} -> '1300 mi'; {{convert|5|to|10|km}} -> '5 to 10 km'."""
    pos = a.pos()
    if not pos:
        return ""
    out = [pos[0]]
    i = 1
    while i + 1 < len(pos) and pos[i] in _RANGE_WORDS:
        out += [pos[i], pos[i + 1]]
        i += 2
    if i < len(pos) and pos[i]:
        out.append(pos[i])
    return " ".join(out).replace(" - ", "–")


def _frac(a: _Args) -> str:
    pos = a.pos()
    if len(pos) == 1:
        return f"1/{pos[0]}"
    if len(pos) == 2:
        return f"{pos[0]}/{pos[1]}"
    if len(pos) >= 3:
        return f"{pos[0]} {pos[1]}/{pos[2]}"
    return ""


def _nihongo(a: _Args) -> str:
    """{{nihongo|English|漢字|rōmaji|extra}} -> 'English (漢字, rōmaji, extra)'."""
    english, kanji, romaji, extra = (a.pos() + ["", "", "", ""])[:4]
    lead = english or romaji or kanji
    rest = [x for x in (kanji, romaji, extra) if x and x != lead]
    return f"{lead} ({', '.join(rest)})" if rest else lead


_IPA_LABELS = {"lang", "local", "pron", "pronunciation", "us", "uk", "ipa", "-", "also",
               "ca", "au", "nz", "ie", "sa", "in"}


def _ipac(a: _Args) -> str:
    """{{IPAc-en|ˈ|æ|n|ər}} -> '/ˈænər/' (leading labels such as 'US', 'pron' skipped)."""
    pos = a.pos()
    while pos and pos[0].lower() in _IPA_LABELS:
        pos = pos[1:]
    return f"/{''.join(pos)}/" if pos else ""


def _columns(a: _Args) -> str:
    """{{columns|col1=...|col2=...}}: every colN in order."""
    cols = sorted((int(m.group(1)), str(p.name).strip()) for p in a.tpl.params
                  if (m := re.fullmatch(r"\s*col(\d+)\s*", str(p.name))))
    return "".join(_block(a.block(name)) for _, name in cols)


def _quote(a: _Args) -> str:
    for key in ("text", "quote", "1"):
        if a.tpl.has(key):
            return _block(a.block(key))
    return ""


def _as_of(a: _Args) -> str:
    pos = a.pos()
    if not pos:
        return ""
    date = pos[0]
    if len(pos) >= 2:
        try:
            date = f"{MONTHS[int(pos[1]) - 1]} {pos[0]}"
            if len(pos) >= 3:
                date = f"{pos[2].lstrip('0')} {date}"
        except (ValueError, IndexError):
            pass
    lead = "as of" if a.raw("lc").lower() in ("y", "yes", "on") else "As of"
    return f"{lead} {date}"


def _const(s: str):
    return lambda a: s


def _wrap(left: str, right: str, key=1):
    return lambda a: f"{left}{a.get(key)}{right}" if a.get(key) else ""


_SYMBOLS = {"!": "|", "=": "=", "'": "'", "'s": "'s", "`": "'", "·": " · ", "dot": " · ",
            "middot": " · ", "bull": " • ", "snd": " – ", "spnd": " – ", "spaced ndash": " – ",
            "sndash": " – ", "ndash": "–", "mdash": "—", "spaced mdash": " — ", "nbsp": " ",
            "pipe": "|", "spaces": " ", "sp": " ", "thinsp": " ", "en dash": "–", "em dash": "—",
            "·wrap": " · ", "•": " • ", "and": " and ", "\\": " / ", "slash": "/"}

TEMPLATES: dict[str, Callable[[_Args], str]] = {
    **{name: _first for name in (
        "nowrap", "nobr", "small", "smaller", "big", "larger", "large", "linktext", "nobold",
        "noitalic", "noitalics", "abbr", "abbrlink", "tooltip", "sc", "smallcaps", "small caps",
        "em", "strong", "var", "mvar", "math", "vanchor", "visible anchor", "ill",
        "interlanguage link", "interlanguage link multi", "unicode", "ipa", "ipa symbol",
        "keypress", "sup", "sub", "allow wrap", "no wrap", "lang2", "nihongo2",
        "text", "clarify span", "resize", "center", "nowrap begin", "chem2", "ce", "proper name", "mono", "code",
        "highlight", "serif", "sans-serif", "samp", "lang name", "not a typo",
        "as written", "typo", "flagcountry", "flag country", "flagu", "flag")},
    **{name: _second for name in ("lang", "script", "native name", "native phrase", "audio",
                                  "langx", "transliteration")},
    "transl": _last_positional, "columns-list": _last_block, "col-list": _last_block,
    "collist": _last_block, "div col": lambda a: _block(a.block("content")),
    "columns": _columns, **{name: lambda a: _block(a.block(1)) for name in (
        "plainlist", "flatlist", "flat list", "plain list")},
    **{name: lambda a: _items(a.pos()) for name in (
        "hlist", "unbulleted list", "ubl", "ubil", "unbulleted indent list", "bulleted list",
        "blist", "bulletlist", "ordered list", "bare list", "enum")},
    "sic": lambda a: "".join(a.pos()[:2]),
    "chem": lambda a: "".join(a.pos()),
    "val": _val, "convert": _convert, "cvt": _convert, "frac": _frac, "sfrac": _frac,
    "fraction": _frac, "nihongo": _nihongo, "ipac-en": _ipac, "ipac": _ipac,
    "respell": lambda a: "-".join(a.pos()), "angbr": _wrap("⟨", "⟩"), "bracket": _wrap("[", "]"),
    "quote": _quote, "blockquote": _quote, "cquote": _quote, "quotation": _quote,
    "quote box": _quote, "poem quote": _quote,
    "as of": _as_of, "circa": lambda a: f"c. {a.get(1)}".strip(), "c.": lambda a: f"c. {a.get(1)}".strip(),
    "birth date": _date, "death date": _date, "start date": _date, "end date": _date,
    "dts": _date, "birth date and age": _birth_age, "start date and age": _birth_age,
    "death date and age": _age,
    "nts": _first, "ntsh": lambda a: "", "sortname": lambda a: " ".join(a.pos()[:2]),
    "us$": lambda a: f"US${a.get(1)}", "£": lambda a: f"£{a.get(1)}", "€": lambda a: f"€{a.get(1)}",
    "simplenuclide2": lambda a: "-".join(a.pos()[:2]), "simplenuclide": lambda a: "-".join(a.pos()[:2]),
    **{name: _const(s) for name, s in _SYMBOLS.items()},
}

_PARSER_FUNCTIONS = {"formatnum": lambda s: s, "lc": str.lower, "uc": str.upper,
                     "lcfirst": lambda s: s[:1].lower() + s[1:],
                     "ucfirst": lambda s: s[:1].upper() + s[1:]}


@lru_cache(maxsize=4096)
def template_renderer(raw_name: str) -> Optional[Callable]:
    """How a template named ``raw_name`` (its name as written: 'Lang_fr ') renders: a
    function of the Template node giving its visible text, or None for a template that is
    dropped. Decided by the name alone, so the token renderer skips dropped templates
    without building them."""
    name = template_name(raw_name)
    fn = TEMPLATES.get(name)
    if fn is None and name.startswith(("lang-", "lang ")):
        fn = _first                          # {{lang-grc|Φοῖβος}}
    if fn is None and name.startswith("ipa-"):
        fn = _wrap("[", "]")                 # {{IPA-de|ˈbɛʁlɪn}} -> [ˈbɛʁlɪn]
    if fn is None and ":" in name:           # {{formatnum:1234}}, {{lc:Word}}
        func, _, rest = raw_name.partition(":")
        conv = _PARSER_FUNCTIONS.get(func.strip().lower())
        if conv is not None:
            return lambda tpl: conv(wikicode_text(mwparserfromhell.parse(rest).nodes).strip())
    return None if fn is None else lambda tpl: fn(_Args(tpl))


def template_text(tpl) -> Optional[str]:
    """Visible text of a template that carries prose; None for templates that are dropped."""
    fn = template_renderer(str(tpl.name))
    return None if fn is None else fn(tpl)


def visible_link_text(title: str, text: Optional[Callable[[], str]]) -> Optional[str]:
    """Visible text of a [[wikilink]] from its rendered title and ``text()``, its rendered
    text (None: no pipe); None for files, categories and interlanguage links."""
    title = title.replace(MARK, "").strip()
    colon_prefixed = title.startswith(":")      # [[:Category:X]] links to the page, shows text
    title = title.lstrip(":")
    prefix = title.split(":", 1)[0].strip().lower() if ":" in title else ""
    if not colon_prefixed and prefix in DROP_LINK_NAMESPACES:
        return None
    if text is None:
        if not colon_prefixed and prefix and _LANG_PREFIX.match(prefix):
            return None   # [[fr:Anarchisme]]: an interlanguage link, not text
        return title
    shown = text()
    if not shown.replace(MARK, "").strip():     # pipe trick [[Foo (bar)|]] shows "Foo"
        return re.sub(r"\s*\(.*?\)\s*$", "", title.split(":", 1)[-1])
    return shown


def _link_text(link) -> Optional[str]:
    """Visible text of a Wikilink node (:func:`visible_link_text`)."""
    return visible_link_text(wikicode_text(link.title.nodes),
                             None if link.text is None else lambda: wikicode_text(link.text.nodes))


def render_nodes(nodes, out: list) -> None:
    """Render mwparserfromhell nodes into ``out``: plain-text strings (with MARKs where
    markup was dropped), plus a HeadingMark wherever a heading occurs, even nested (an
    unclosed '' can swallow later headings)."""
    for node in nodes:
        if isinstance(node, mw.Text):
            out.append(decode_entities(node.value))
        elif isinstance(node, mw.Wikilink):
            text = _link_text(node)
            out.append(MARK if text is None else text)
        elif isinstance(node, mw.Tag):
            tag = str(node.tag).strip().lower()
            markup = node.wiki_markup
            if tag in DROP_TAGS:
                out.append(MARK)
                continue
            if tag in CHEM_TAGS:
                formula = str(node.contents).strip() if node.contents is not None else ""
                out.append(formula.replace("->", "→") if _SIMPLE_CHEM.match(formula) else MARK)
                continue
            if markup in ("*", "#", ";", ":", "----"):
                out.append("\n\n")              # list item / indent / rule: new paragraph
            elif tag == "br":
                out.append(" ")
            elif tag in BREAK_TAGS:
                out.append("\n\n")
            if node.contents is not None and not node.self_closing:
                render_nodes(node.contents.nodes, out)
                if tag in BREAK_TAGS:
                    out.append("\n\n")
        elif isinstance(node, mw.HTMLEntity):
            out.append(decode_entities(str(node)))
        elif isinstance(node, mw.ExternalLink):
            if node.title is not None:
                render_nodes(node.title.nodes, out)
            else:
                out.append(MARK)                # a bare URL
        elif isinstance(node, mw.Template):
            text = template_text(node)
            out.append(MARK if text is None else text)
        elif isinstance(node, mw.Heading):
            out.append(HeadingMark(node.level, wikicode_text(node.title.nodes)))
        else:                                   # Comment, Argument ({{{1}}}) ...: dropped
            out.append(MARK)


def wikicode_text(nodes) -> str:
    """Plain text of mwparserfromhell nodes (a heading inside becomes its own paragraph)."""
    out: list = []
    render_nodes(nodes, out)
    return _joined(out)


def _joined(pieces: list) -> str:
    return "".join(f"\n\n{x.title}\n\n" if isinstance(x, HeadingMark) else x for x in pieces)


# --------------------------------------------------------------------------- tokens
# mwparserfromhell parses in two steps: its C tokenizer turns wikitext into a flat list of
# tokens, then a pure-Python builder turns the list into a node tree. The builder is most of
# the cost (about 70% of a whole article's conversion), and most of what it builds is then
# dropped: references, citations, infoboxes, tables. _TokenRenderer renders straight from
# the tokens by the rules of render_nodes, skipping a dropped construct without building it;
# only what reads a node (a template that carries text, a <chem> formula's raw text, a tag
# with an unusual name) is built, from its own tokens, and rendered by render_nodes itself.
# A token sequence the renderer does not expect raises _Unexpected, and the whole article
# then takes the node path: the text is the node path's in every case.
_OPEN_CLOSE = {tk.TemplateOpen: (tk.TemplateClose,), tk.ArgumentOpen: (tk.ArgumentClose,),
               tk.WikilinkOpen: (tk.WikilinkClose,), tk.ExternalLinkOpen: (tk.ExternalLinkClose,),
               tk.HeadingStart: (tk.HeadingEnd,), tk.CommentStart: (tk.CommentEnd,),
               tk.HTMLEntityStart: (tk.HTMLEntityEnd,),
               tk.TagOpenOpen: (tk.TagCloseSelfclose, tk.TagCloseClose)}
_TEMPLATE_NAME_END = (tk.TemplateParamSeparator, tk.TemplateClose)
_TAG_NAME_END = (tk.TagAttrStart, tk.TagCloseOpen, tk.TagCloseSelfclose)
_TAG_OPENED = (tk.TagCloseOpen, tk.TagCloseSelfclose)
_TAG_BODY_END = (tk.TagOpenClose, tk.TagCloseClose)
_LINK_TITLE_END = (tk.WikilinkSeparator, tk.WikilinkClose)
_EXT_URL_END = (tk.ExternalLinkSeparator, tk.ExternalLinkClose)
_LIST_MARKUP = ("*", "#", ";", ":", "----")


class _Unexpected(Exception):
    """A token sequence the token renderer does not model (the node path renders it)."""


class _TokenRenderer:
    """Renders a token list into the pieces render_nodes would make of its node tree."""

    def __init__(self, tokens: list):
        self.tokens = tokens

    def run(self, i: int, out: list, stops: tuple = ()) -> int:
        """Render from token i up to a token of a type in ``stops`` at this level (whose
        index is returned), or to the end when ``stops`` is empty."""
        tokens, n = self.tokens, len(self.tokens)
        while i < n:
            token = tokens[i]
            kind = type(token)
            if kind is tk.Text:
                out.append(decode_entities(token["text"]))
                i += 1
            elif kind in stops:
                return i
            else:
                handler = _TOKEN_HANDLERS.get(kind)
                if handler is None:
                    raise _Unexpected(kind.__name__)
                i = handler(self, i, out)
        if stops:
            raise _Unexpected("ran out of tokens")
        return i

    def end(self, i: int) -> int:
        """The index just after the construct that opens at token i."""
        tokens, opener = self.tokens, type(self.tokens[i])
        closers, depth = _OPEN_CLOSE[opener], 0
        for j in range(i, len(tokens)):
            kind = type(tokens[j])
            if kind is opener:
                depth += 1
            elif kind in closers:
                depth -= 1
                if depth == 0:
                    return j + 1
        raise _Unexpected(f"{opener.__name__} never closed")

    def skip(self, i: int, stops: tuple) -> int:
        """The index of the first token of a type in ``stops`` at this level from i on."""
        tokens, n = self.tokens, len(self.tokens)
        while i < n:
            kind = type(tokens[i])
            if kind in stops:
                return i
            i = self.end(i) if kind in _OPEN_CLOSE else i + 1
        raise _Unexpected("ran out of tokens")

    def name(self, i: int, stops: tuple) -> tuple[Optional[str], int]:
        """The text of the Text tokens from i up to a token of a type in ``stops``, and that
        token's index; None when another token comes first."""
        tokens, parts = self.tokens, []
        while i < len(tokens):
            token = tokens[i]
            if type(token) is tk.Text:
                parts.append(token["text"])
                i += 1
            elif type(token) in stops:
                return "".join(parts), i
            else:
                return None, i
        raise _Unexpected("ran out of tokens")

    def as_nodes(self, i: int, out: list) -> int:
        """Build the construct at token i into a node and render it with render_nodes."""
        j = self.end(i)
        render_nodes(Builder().build(self.tokens[i:j]).nodes, out)
        return j

    def template(self, i: int, out: list) -> int:
        raw, _ = self.name(i + 1, _TEMPLATE_NAME_END)
        if raw is None or template_renderer(raw) is not None:
            return self.as_nodes(i, out)
        out.append(MARK)
        return self.end(i)

    def tag(self, i: int, out: list) -> int:
        markup = self.tokens[i].get("wiki_markup")
        raw, k = self.name(i + 1, _TAG_NAME_END)
        if raw is None:
            return self.as_nodes(i, out)
        tag = raw.strip().lower()
        if tag in DROP_TAGS:
            out.append(MARK)
            return self.end(i)
        if tag in CHEM_TAGS:
            return self.as_nodes(i, out)
        k = self.skip(k, _TAG_OPENED)                       # past the attributes
        if markup in _LIST_MARKUP:
            out.append("\n\n")
        elif tag == "br":
            out.append(" ")
        elif tag in BREAK_TAGS:
            out.append("\n\n")
        if type(self.tokens[k]) is tk.TagCloseSelfclose:
            return k + 1
        contents: list = []
        k = self.run(k + 1, contents, _TAG_BODY_END)
        if type(self.tokens[k]) is tk.TagCloseClose:     # no closing tag: no contents
            return k + 1
        out += contents
        if tag in BREAK_TAGS:
            out.append("\n\n")
        return self.skip(k + 1, (tk.TagCloseClose,)) + 1

    def wikilink(self, i: int, out: list) -> int:
        title: list = []
        k = self.run(i + 1, title, _LINK_TITLE_END)
        if type(self.tokens[k]) is tk.WikilinkClose:
            shown, j = visible_link_text(_joined(title), None), k + 1
        else:
            def text() -> str:
                parts: list = []
                self.run(k + 1, parts, (tk.WikilinkClose,))
                return _joined(parts)
            shown, j = visible_link_text(_joined(title), text), self.end(i)
        out.append(MARK if shown is None else shown)
        return j

    def external_link(self, i: int, out: list) -> int:
        k = self.skip(i + 1, _EXT_URL_END)
        if type(self.tokens[k]) is tk.ExternalLinkClose:
            out.append(MARK)                                # a bare URL
            return k + 1
        return self.run(k + 1, out, (tk.ExternalLinkClose,)) + 1

    def entity(self, i: int, out: list) -> int:
        kinds = [type(t) for t in self.tokens[i + 1:i + 5]]
        if kinds[:4] == [tk.HTMLEntityNumeric, tk.HTMLEntityHex, tk.Text, tk.HTMLEntityEnd]:
            text, j = f"&#{self.tokens[i + 2]['char']}{self.tokens[i + 3]['text']};", i + 5
        elif kinds[:3] == [tk.HTMLEntityNumeric, tk.Text, tk.HTMLEntityEnd]:
            text, j = f"&#{self.tokens[i + 2]['text']};", i + 4
        elif kinds[:2] == [tk.Text, tk.HTMLEntityEnd]:
            text, j = f"&{self.tokens[i + 1]['text']};", i + 3
        else:
            raise _Unexpected("HTML entity")
        out.append(decode_entities(text))
        return j

    def heading(self, i: int, out: list) -> int:
        title: list = []
        k = self.run(i + 1, title, (tk.HeadingEnd,))
        out.append(HeadingMark(self.tokens[i]["level"], _joined(title)))
        return k + 1

    def dropped(self, i: int, out: list) -> int:           # comments, {{{arguments}}}
        out.append(MARK)
        return self.end(i)


_TOKEN_HANDLERS = {tk.TemplateOpen: _TokenRenderer.template, tk.TagOpenOpen: _TokenRenderer.tag,
                   tk.WikilinkOpen: _TokenRenderer.wikilink,
                   tk.ExternalLinkOpen: _TokenRenderer.external_link,
                   tk.HTMLEntityStart: _TokenRenderer.entity, tk.HeadingStart: _TokenRenderer.heading,
                   tk.CommentStart: _TokenRenderer.dropped, tk.ArgumentOpen: _TokenRenderer.dropped}


def tokenize(wikitext: str) -> list:
    """mwparserfromhell's tokens of ``wikitext`` (its C tokenizer when built), exactly what
    ``mwparserfromhell.parse`` builds its tree from."""
    return (CTokenizer() if CTokenizer is not None else Tokenizer()).tokenize(wikitext, 0, False)


def render_tokens(tokens: list) -> list:
    """Tokens -> what render_nodes makes of their node tree (strings and HeadingMarks), by
    the token renderer; by the node tree itself when the tokens hold a sequence the token
    renderer does not model."""
    pieces: list = []
    try:
        _TokenRenderer(tokens).run(0, pieces)
    except _Unexpected:
        pieces = []
        render_nodes(Builder().build(list(tokens)).nodes, pieces)
    return pieces


# A comment (group 1: kept), or a <ref>...</ref> (or <ref .../>) holding no other ref and no
# comment. Every branch starts with "<", which lets the regex engine skip to the next "<".
_REF_OR_COMMENT = re.compile(r"<(?:(!--.*?(?:-->|\Z))|ref(?=[\s/>])[^<>]*/>"
                             r"|ref(?=[\s>])[^<>]*>[^<]*(?:<(?!/?ref[\s/>]|!--)[^<]*)*</ref\s*>)",
                             re.S | re.I)


def cut_references(wikitext: str) -> str:
    """Replace each <ref> with a MARK before parsing, as MediaWiki itself takes extension
    tags out before it parses the rest; a comment is skipped whole, so a ref inside one stays
    part of it. References are about a third of an article's wikitext and of the
    tokenizer's time, and are dropped anyway; a ref that nests another ref or holds a
    comment is left to the parser."""
    return _REF_OR_COMMENT.sub(lambda m: m.group(0) if m.group(1) else MARK, wikitext)


# Where templates and tables start and end, found as MediaWiki's preprocessor finds them:
# comments and the extension tags whose content is not wikitext (mwparserfromhell's
# PARSER_BLACKLIST) are skipped whole; "{{" and "}}" pair up; "{|" and "|}" count at the
# start of a line (or after one space there), as in the tokenizer.
_OPAQUE_TAGS = ("categorytree", "ce", "chem", "gallery", "graph", "hiero", "imagemap",
                "inputbox", "math", "nowiki", "pre", "score", "section", "source",
                "syntaxhighlight", "templatedata", "timeline")
_STRUCTURE = re.compile(rf"<!--|<(?:{'|'.join(_OPAQUE_TAGS)})(?=[\s/>])|\{{\{{+|\}}\}}+"
                        r"|\n[^\S\n]?(?:\{\||\|\})", re.I)
# A template name ends at the first "|"; with markup before it ("{", "[", "<" ...) or a line
# break inside it, the tokenizer does not take the braces as a template, and neither do we.
_NAME_END = re.compile(r"[|{}\[\]<>]")


def cut_dropped_blocks(wikitext: str) -> str:
    """Replace each dropped template (:func:`template_renderer` is None for its name) and
    each table outside templates with a MARK before parsing, as the node path renders them;
    the tokenizer never sees them (infoboxes, navboxes and tables cost it half its time).
    Only what is certain is cut: a template whose name holds markup stays, and a "{{{"
    argument, an unclosed comment or tag, or a table that does not close at the template
    depth it opened at stop the cutting there: the parser takes the rest as it is."""
    text = "\n" + wikitext                    # a table may open on the first line
    cuts: list[tuple[int, int]] = []          # [start, end) spans, in order, outermost only
    opens: list[int] = []                     # start of each "{{" not yet closed
    tables: list[tuple[int, int]] = []        # (start, len(opens) then) of each open table
    m = _STRUCTURE.search(text)
    while m:
        token, pos, resume = m.group(0), m.start(), m.end()
        if token[0] == "<":
            resume = _opaque_end(text, m)
            if resume < 0:
                break
        elif token[0] == "\n":
            if token.endswith("{|"):
                tables.append((resume - 2, len(opens)))
            elif tables:
                begin, depth = tables.pop()
                if depth != len(opens):
                    break
                if depth == 0:
                    _add_cut(cuts, begin, resume)
        elif len(token) % 2:
            break                              # "{{{" or "}}}": a template argument
        elif token[0] == "{":
            opens += range(pos, resume, 2)
        else:
            for end in range(pos + 2, resume + 1, 2):
                if not opens:
                    break
                begin = opens.pop()
                stop = _NAME_END.search(text, begin + 2, end - 2)   # never past a nested "{{"
                if stop and stop.group() != "|":
                    continue                   # markup in the name: the tokenizer's call
                name = text[begin + 2:stop.start() if stop else end - 2]
                if name.strip() and "\n" not in name.strip() and template_renderer(name) is None:
                    _add_cut(cuts, begin, end)
        m = _STRUCTURE.search(text, resume)
    if not cuts:
        return wikitext
    out, last = [], 0
    for begin, end in cuts:
        out += [text[last:begin], MARK]
        last = end
    out.append(text[last:])
    return "".join(out)[1:]


def _add_cut(cuts: list, begin: int, end: int) -> None:
    while cuts and cuts[-1][0] >= begin:      # spans inside this one
        cuts.pop()
    cuts.append((begin, end))


def _opaque_end(text: str, m: re.Match) -> int:
    """Where the comment or opaque tag at ``m`` ends (-1: it never does)."""
    if m.group(0) == "<!--":
        end = text.find("-->", m.end())
        return end + 3 if end >= 0 else -1
    name = m.group(0)[1:]
    gt = text.find(">", m.end())
    if gt < 0:
        return -1
    if text[gt - 1] == "/":
        return gt + 1                          # <nowiki/>
    close = re.compile(rf"</{name}\s*>", re.I).search(text, gt)
    return close.end() if close else -1


def render(wikitext: str) -> list:
    """Wikitext -> pieces: strings (MARKed text) and HeadingMarks, in document order.
    Constructs the parser left as plain text are removed by :func:`strip_leftover_markup`."""
    wikitext = cut_dropped_blocks(cut_references(wikitext.replace(MARK, "")))
    pieces = render_tokens(tokenize(wikitext))
    out: list = []
    run: list[str] = []
    for piece in pieces:
        if isinstance(piece, HeadingMark):
            out.append(strip_leftover_markup("".join(run)))
            run = []
            out.append(HeadingMark(piece.level, strip_leftover_markup(piece.title)))
        else:
            run.append(piece)
    out.append(strip_leftover_markup("".join(run)))
    return out


def article_text(wikitext: str, builder: ArticleBuilder) -> str:
    """Cleaned plain text of one article's wikitext (sections tracked through headings)."""
    for piece in render(wikitext):
        if isinstance(piece, HeadingMark):
            builder.heading(piece.level, piece.title, marked=True)
        else:
            builder.add_text(piece, marked=True)
    return builder.text()


# Leftovers of constructs mwparserfromhell could not parse (it keeps them as plain text,
# e.g. a table with broken quoting or a bold/italic run that never closes).
_LEFTOVER_HINT = re.compile(r"\[\[|\{\{|\{\||<|''|\n[^\S\n]*\|")     # each starts with a literal
_LEFTOVER_SUBS = [
    (re.compile(r"<!--.*?(?:-->|$)", re.S), MARK),
    (re.compile(r"<ref[^<>]*/>|<ref[^<>]*>.*?</ref>", re.S | re.I), MARK),
    (re.compile(r"^\{\|.*?^\|\}", re.S | re.M), "\n\n"),          # a whole table
    (re.compile(r"^[ \t]*(?:\{\||\|).*$", re.M), ""),                # stray table rows
]
_LEFTOVER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_LEFTOVER_FILE_LINK = re.compile(r"\[\[\s*(?:file|image|media|category)\s*:[^\[\]]*\]\]", re.I)
_LEFTOVER_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]")
_LEFTOVER_TAG = re.compile(r"</?[a-zA-Z][a-zA-Z0-9]*(?:\s[^<>]*)?/?>")
_LEFTOVER_QUOTES = re.compile(r"'{2,}")


def strip_leftover_markup(text: str) -> str:
    """Regex fallback for wikitext that survived parsing as plain text: refs, templates,
    tables, file/category links and tags are dropped (leaving MARKs), [[link|text]]
    becomes text."""
    if not _LEFTOVER_HINT.search(text) and not text.lstrip().startswith("|"):
        return text
    for pattern, repl in _LEFTOVER_SUBS:
        text = pattern.sub(repl, text)
    for _ in range(20):                      # innermost first, until nothing nested is left
        new = _LEFTOVER_TEMPLATE.sub(MARK, text)
        new = _LEFTOVER_FILE_LINK.sub(MARK, new)
        new = _LEFTOVER_LINK.sub(r"\1", new)
        if new == text:
            break
        text = new
    text = _LEFTOVER_TAG.sub("", text)
    return _LEFTOVER_QUOTES.sub("", text)
