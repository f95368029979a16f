"""Tests for utils/data/wikitext.py: templates rendered to their visible text, entities decoded
once, punctuation tidied only where markup was removed, section titles matched by words,
surrogates and control characters repaired. A few checks run on the real sample dump."""
from __future__ import annotations

import bz2
import random
import re
import time
from collections import Counter

import mwparserfromhell
import pytest
from mwparserfromhell.parser import Builder
from mwparserfromhell.parser import tokens as tk

from tests.conftest import ENWIKI_XML
from utils.data import mediawiki
from utils.data import wikitext as wt

DEFAULT_DROP = ["References", "External links", "See also", "Further reading", "Notes",
                "Bibliography", "Sources", "Citations", "Footnotes", "Notes and references",
                "References and notes", "Works cited", "Cited works", "Sources and further reading"]


def text_of(wikitext: str, drop=DEFAULT_DROP) -> str:
    return wt.article_text(wikitext, wt.ArticleBuilder(wt.SectionMatcher(drop)))


# --------------------------------------------------------------------------- templates
@pytest.mark.parametrize("source, expected", [
    ("{{Nihongo|'''Aikido'''|合気道|Aikidō|lead=yes}} is a martial art.",
     "Aikido (合気道, Aikidō) is a martial art."),
    ("{{nihongo|headquarters|本部道場|honbu dōjō}}", "headquarters (本部道場, honbu dōjō)"),
    ("with {{lang|fr|une chose}} flavour", "with une chose flavour"),
    ("Phoebus ({{lang-grc|Φοῖβος}}, ''Phoibos'')", "Phoebus (Φοῖβος, Phoibos)"),
    ("name {{transl|ar|al-Jazā'ir}}", "name al-Jazā'ir"),
    ("anthem {{transl|ur|ALA-LC|''Millī Surūd''}}", "anthem Millī Surūd"),
    ("letter {{Script|Copt|Ⲁ ⲁ}} here", "letter Ⲁ ⲁ here"),
    ("roughly {{val|6.241|e=18}} times", "roughly 6.241×10^18 times"),
    ("about {{val|30000|u=C}} hot", "about 30000 C hot"),
    ("mass {{val|1.00794|0.00007}} u", "mass 1.00794 ± 0.00007 u"),
    ("a {{convert|1300|mi|km}} road", "a 1300 mi road"),
    ("from {{convert|5|to|10|km}}", "from 5 to 10 km"),
    ("water is {{chem|H|2|O}}.", "water is H2O."),
    ("alkanes {{chem|C|''n''|H|2''n''+2}}", "alkanes CnH2n+2"),
    ("{{nowrap|10 km}} and {{small|(1832)}} and {{smaller|(x)}}", "10 km and (1832) and (x)"),
    ("the word {{sic|Tyo|ta}} and {{sic|recieve}}", "the word Tyota and recieve"),
    ("said {{IPA|/æ/}} and {{IPA-de|ˈbɛʁlɪn|lang}}", "said /æ/ and [ˈbɛʁlɪn]"),
    ("pronounced {{IPAc-en|audio=x.ogg|ˌ|æ|l|ə}} or {{respell|ə|GLEE|teez}}",
     "pronounced /ˌælə/ or ə-GLEE-teez"),
    ("born {{birth date|1809|2|12}}; died {{death date and age|1865|4|15|1809|2|12}}",
     "born February 12, 1809; died April 15, 1865 (aged 56)"),
    ("born {{birth date|df=yes|1885|4|3}}", "born 3 April 1885"),
    ("{{as of|2014|lc=y}}, and {{As of|2010}}", "as of 2014, and As of 2010"),
    ("a {{frac|1|2}} share, {{formatnum:1234567}} people", "a 1/2 share, 1234567 people"),
    ("rock{{snd}}roll{{'s}} {{!}} {{nbsp}}x", "rock – roll's | x"),
    ("{{quote|To be or not to be.}}", "To be or not to be."),
])
def test_text_carrying_templates_render_their_text(source, expected):
    assert text_of(source) == expected


@pytest.mark.parametrize("source, items", [
    ("{{Columns-list|2|\n* [[Academy Award for Best Picture|Best Picture]]: since 1928\n* Best Director\n}}",
     ["Best Picture: since 1928", "Best Director"]),
    ("{{columns-list|colwidth=30em|\n* One\n* Two\n}}", ["One", "Two"]),
    ("{{Columns |width=13.7em\n| col1 =\n* Alto Vista\n* Antilla\n| col2 =\n* Arikok\n}}",
     ["Alto Vista", "Antilla", "Arikok"]),
    ("{{div col|colwidth=20em}}\n* Apple\n* Pear\n{{div col end}}", ["Apple", "Pear"]),
    ("{{Plainlist|\n* Württemberg (1879–1896)\n* Switzerland\n}}", ["Württemberg (1879–1896)", "Switzerland"]),
    ("{{flatlist|\n* a1\n* b1\n}}", ["a1", "b1"]),
    ("{{hlist|[[Biology]]|[[Zoology]]|Ethics}}", ["Biology", "Zoology", "Ethics"]),
    ("{{Unbulleted list |[[Peripatetic school]] |[[Aristotelianism]]}}",
     ["Peripatetic school", "Aristotelianism"]),
])
def test_list_wrappers_keep_every_item(source, items):
    assert text_of("Intro.\n" + source).split("\n") == ["Intro."] + items


@pytest.mark.parametrize("source", ["{{cite web|url=http://x|title=T}}", "{{Infobox thing|name=N}}",
                                    "{{citation needed|date=May 2020}}", "{{main|Other}}",
                                    "{{reflist}}", "{{coord|1|2}}", "{{inflation|US|5|1929}}"])
def test_other_templates_are_dropped(source):
    assert text_of(f"Kept text. {source}") == "Kept text."


# --------------------------------------------------------------------------- entities
def test_html_entities_decoded_in_links_and_text():
    assert text_of("[[OS&nbsp;X]] uses the Kruskal&ndash;Wallis test") == \
        "OS X uses the Kruskal–Wallis test"
    assert text_of("[[Mac OS&nbsp;X|Mac&nbsp;OS]] and [[A&amp;B]]") == "Mac OS and A&B"
    assert text_of("{{lang|fr|caf&eacute;}} &copy;2001 &#233;&#xE9;") == "café ©2001 éé"


@pytest.mark.parametrize("source, expected", [
    ("write &amp;nbsp; for a space", "write &nbsp; for a space"),   # decoded once, never twice
    ("&amp;amp;amp;", "&amp;amp;"),
    ("AT&T and R&D &unknownentity; &copy", "AT&T and R&D &unknownentity; &copy"),
    ("bad &#xD800; &#99999999; end", "bad \ufffd \ufffd end"),
    ("ctrl &#1;&#x7f; end", "ctrl end"),
])
def test_entities_decoded_exactly_once_and_safely(source, expected):
    assert text_of(source) == expected
    assert wt.decode_entities("&amp;lt;") == "&lt;"


# --------------------------------------------------------------------------- tidy-up
@pytest.mark.parametrize("real_text", [
    "call printf() to print; main() returns 0.",
    "an empty tuple () and a list [] ; odd spacing , kept",
    "Phoebus (, Phoibos) as written by hand.",
    "x ( ) y : z",
])
def test_tidy_up_never_rewrites_real_text(real_text):
    assert text_of(real_text) == real_text


@pytest.mark.parametrize("source, expected", [
    ("Phoebus ({{lang-unknowncode-x}}{{foo}}, Phoibos) was", "Phoebus (Phoibos) was"),
    ("Achilles ({{IPAc-xx-unknown|a}}; born 1950)", "Achilles (born 1950)"),
    ("Akhilleus, {{foo}}) was", "Akhilleus) was"),
    ("He ({{foo}}) left.", "He left."),
    ("He ({{foo}}; {{bar}}) left.", "He left."),
    ("Paris<ref>r</ref> is big{{cn}}.", "Paris is big."),
    ("text {{citation needed}} , more", "text, more"),
    ("word, {{foo}}, more", "word, more"),
    ("See [[File:x.png|thumb|c]] above.", "See above."),
    ("<math>x</math>, which means y.", "which means y."),        # the start was removed
    ("{{foo}}. Then more.", "Then more."),
])
def test_tidy_up_cleans_what_markup_removal_left(source, expected):
    assert text_of(source) == expected


def test_tidy_up_on_runs_equals_tidy_up_on_the_whole_paragraph():
    """The tidy patterns run on each run of whitespace, punctuation and MARKs holding a MARK;
    applied one after another to the whole paragraph, they give the same text."""
    def whole(text: str) -> str:
        for pattern, repl in (wt._TIDY_START, *wt._TIDY):
            text = pattern.sub(repl, text)
        return text

    rng = random.Random(7)
    alphabet = ["word", "x", " ", "  ", ",", ";", ":", ".", "!", "?", "(", ")", wt.MARK, wt.MARK]
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 16)))
        runs = wt._TIDY_RUN.sub(lambda m: wt._tidy_run(m.group(0), m.start() == 0), text)
        assert runs == whole(text), repr(text)


def test_sentinel_in_input_is_not_markup():
    assert wt.MARK not in text_of(f"a{wt.MARK} (b) c{wt.MARK}.")
    assert text_of(f"printf(){wt.MARK} x") == "printf() x"


# --------------------------------------------------------------------------- sections
@pytest.mark.parametrize("title", [
    "References", "Selected bibliography", "Reference literature", "Etymological bibliography",
    "Notes and references", "Notes & References", "Bibliographies", "Primary sources",
    "Secondary sources", "Additional references", "References and further reading",
    "Further reading and external links", "Works cited", "  EXTERNAL   links ", "Source",
    "Notes, references and sources", "''Selected'' bibliography",
])
def test_reference_like_sections_are_dropped(title):
    assert wt.SectionMatcher(DEFAULT_DROP)(wt.clean_paragraph(title))
    assert "BODY" not in text_of(f"Lead text.\n== {title} ==\nBODY ISBN 0-00\n== Legacy ==\nKept.")


@pytest.mark.parametrize("title", ["Literature", "Selected works", "Notes on pronunciation",
                                   "History", "Sources of the Nile", "Works", "Linked data",
                                   "Reception", "Also-rans"])
def test_other_sections_are_kept(title):
    assert not wt.SectionMatcher(DEFAULT_DROP)(title)
    assert "BODY" in text_of(f"Lead text.\n== {title} ==\nBODY text.")


def test_dropped_titles_are_counted():
    b = wt.ArticleBuilder(wt.SectionMatcher(DEFAULT_DROP))
    wt.article_text("Lead.\n== Selected bibliography ==\nx\n=== Novels ===\ny\n"
                    "== References ==\nz\n== Notes ==\nw", b)
    assert b.dropped == Counter({"Selected bibliography": 1, "References": 1, "Notes": 1})


# --------------------------------------------------------------------------- repairs
def test_surrogates_replaced_and_control_characters_removed():
    repairs: Counter = Counter()
    assert wt.clean_paragraph("a\ud800b\x00c\x1bd\x7fe\x85f", repairs=repairs) == "a\ufffdbcde f"
    assert repairs == {"lone surrogate replaced": 1, "control character removed": 3}


def test_leftover_markup_fallback():
    s = "A [[x|link]] and [[plain]]{{t|{{inner}}}}<ref>r</ref> [[File:a.png|thumb|[[c]]]] ''it''\n| row"
    assert wt.strip_leftover_markup(s).replace(wt.MARK, " ").split() == ["A", "link", "and", "plain", "it"]


# --------------------------------------------------------------------------- token renderer
def node_path(wikitext: str) -> list:
    """What render_nodes makes of mwparserfromhell's parse tree: the reference semantics."""
    out: list = []
    wt.render_nodes(mwparserfromhell.parse(wikitext).nodes, out)
    return out


FRAGMENTS = ["{{", "}}", "[[", "]]", "|", "=", "<ref>", "</ref>", "<ref name=a/>", "''", "'''",
             "\n==", "==\n", "<!--", "-->", "{{{", "}}}", "&amp;", "&#x41;", "&#65;", "&bogus;",
             "[http://a.b c]", "http://x.y ", "[http://q.r]", "{|", "|}", "|-", "\n*", "\n#", "\n;",
             ":", "<chem>", "</chem>", "<div>", "</div>", "<br>", "</br>", '<span style="{{x}}">',
             "</span>", "<nowiki>", "</nowiki>", "{{lang|fr|", "{{convert|1|km", "[[File:x.png|thumb|",
             "[[fr:", "[[:Category:", "word ", "\n", "\n\n", "<math>", "</math>", "{{formatnum:",
             "<pre>", "</pre>", "<", ">", "----", "<p>", "<blockquote>", "{{cite web|url=",
             "{{Lang_fr|", "<references/>", "{{val|1|e=3", "{{columns-list|2|\n* a\n* b}}", "\n="]


def test_token_renderer_matches_the_node_path_on_hostile_markup():
    """The fast path (tokens, never a tree for dropped constructs) gives exactly the pieces
    of the node path, on 3,000 random runs of unbalanced, nested and broken markup."""
    rng = random.Random(21)
    for _ in range(3000):
        source = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 30)))
        assert wt.render_tokens(wt.tokenize(source)) == node_path(source), source


def test_token_renderer_matches_the_node_path_on_the_sample(samples):
    with bz2.open(ENWIKI_XML) as f:
        pages = [p.text for p in mediawiki.iter_xml_pages(f)]
    assert len(pages) == 206
    for text in pages:
        fast: list = []
        wt._TokenRenderer(wt.tokenize(text)).run(0, fast)     # no fallback on real articles
        assert fast == node_path(text)


def test_unmodelled_tokens_take_the_node_path():
    # A link with two separators: mwparserfromhell's tokenizer never makes one, its builder
    # takes the text after the last; the token renderer hands such a list to the node path.
    tokens = [tk.Text(text="see "), tk.WikilinkOpen(), tk.Text(text="a"), tk.WikilinkSeparator(),
              tk.Text(text="b"), tk.WikilinkSeparator(), tk.Text(text="c"), tk.WikilinkClose()]
    with pytest.raises(wt._Unexpected):
        wt._TokenRenderer(tokens).run(0, [])
    expected: list = []
    wt.render_nodes(Builder().build(list(tokens)).nodes, expected)
    assert wt.render_tokens(tokens) == expected == ["see ", "c"]


# --------------------------------------------------------------------------- real sample
@pytest.fixture(scope="module")
def sample_articles(samples) -> dict:
    """title -> cleaned text of every article of the real enwiki sample (default options)."""
    opts = mediawiki.CleanOptions(drop_sections=tuple(DEFAULT_DROP))
    with bz2.open(ENWIKI_XML) as f:
        return {p.title: mediawiki.wikitext_article_text(p.text, opts)
                for p in mediawiki.iter_xml_pages(f) if p.ns == 0 and not p.redirect}


@pytest.mark.parametrize("source, expected", [
    ("A<ref>cited</ref> B<ref name=z/> C<REF NAME=x>y</Ref > D.", "A B C D."),
    ("A <!-- x <ref>y</ref> --> B.", "A B."),                # a ref inside a comment is the comment
    ("A <!-- x <ref>y --> B</ref> C.", "A B C."),            # the comment ends first
    ("A<ref>outer<ref>inner</ref> tail</ref> B.", "A B."),   # nested: left to the parser, still dropped
])
def test_references_are_cut_before_parsing(source, expected):
    assert text_of(source) == expected


def test_unclosed_italics_inside_a_reference_keep_the_text_after_it(sample_articles):
    # The references hold an unclosed '' ("''Educação ... inquérito’’"); parsed in place, it
    # swallowed the rest of the section. Cut before parsing, as MediaWiki does, it cannot.
    assert "Leila Lopes, Miss Angola 2011, was crowned Miss Universe 2011" in sample_articles["Angola"]
    assert "45,000 Catholics and 50,000–100,000 Protestants in Algeria." in sample_articles["Algeria"]


M = wt.MARK


@pytest.mark.parametrize("source, expected", [
    ("a {{cite web|url=x}} b", f"a {M} b"),
    ("{{Infobox|a={{b}}|c}}\nText {{lang|fr|x{{cn}}}} y", f"{M}\nText {{{{lang|fr|x{M}}}}} y"),
    ("{|\n|a\n|}\nafter", f"{M}\nafter"),                       # a table on the first line
    ("x\n {|\n|{{cn}}\n|}\ny", f"x\n {M}\ny"),                  # after one space; nested cut
    ("{{a{{b}}|c}}", f"{{{{a{M}|c}}}}"),                        # the inner first, then the name
    ("<!-- {{cn}} --> {{cn}}", f"<!-- {{{{cn}}}} --> {M}"),     # comments are skipped whole
    ("<nowiki>{{cn}}</nowiki>{{cn}}", f"<nowiki>{{{{cn}}}}</nowiki>{M}"),
    ("{{foo\n|x={|\n|a\n|}\n}}", M),                            # a table inside: one cut
    ("{{cn}}}}", f"{M}}}}}"), ("}}{{cn}}", f"}}}}{M}"),          # stray braces stay text
    ("{{{1}}} {{cn}}", "{{{1}}} {{cn}}"),                       # an argument: stop there
    ("{{cn}} <math>{{x}} {{cn}}", f"{M} <math>{{{{x}}}} {{{{cn}}}}"),   # unclosed tag: stop
    ("{{cite <b>x</b>|y}} {{}}", "{{cite <b>x</b>|y}} {{}}"),    # a name with markup, no name
    ("{{cite\nweb|y}} {{Infobox\n|a=b}}", f"{{{{cite\nweb|y}}}} {M}"),  # a break inside a name
])
def test_dropped_templates_and_tables_are_cut_before_parsing(source, expected):
    assert wt.cut_dropped_blocks(source) == expected


def test_cutting_stays_linear_on_hostile_nesting():
    # no "|" anywhere: each name runs into the next "{{", so only the innermost is cut
    deep = "{{a " * 20000 + "x" * 1000 + "}}" * 20000
    start = time.process_time()
    assert wt.cut_dropped_blocks(deep) == "{{a " * 19999 + wt.MARK + "}}" * 19999
    assert time.process_time() - start < 2.0


def test_a_table_the_parser_cannot_read_no_longer_swallows_the_next_section(sample_articles):
    # Alaska's religion table has unbalanced ''' in its cells; parsed in place it took the
    # Economy section with it. Cut whole (tables are dropped anyway), the section stays.
    assert "The 2007 gross state product was $44.9 billion, 45th in the nation." in \
        sample_articles["Alaska"]


def test_sample_dump_keeps_template_text(sample_articles):
    assert sample_articles["Aikido"].startswith("Aikido (合気道, Aikidō) [a.i.ki.doː] is a modern Japanese martial art")
    awards = sample_articles["Academy Awards"]
    for item in ("Best Picture: since 1928", "Best Director: since 1928"):
        assert item in awards.split("\n")
    text = "\n".join(sample_articles.values())
    assert "roughly times" not in text and not re.search(r"\s\(\s*[,;:]?\s*\)", text)
    assert "&nbsp;" not in text and "&ndash;" not in text
    for isbn_section_text in ("Conway, Stephen. The War of American Independence",   # Reference literature
                              "Hamito-Semitic Etymological Dictionary",              # Etymological bibliography
                              "On Vision and Colors"):                               # Selected bibliography
        assert isbn_section_text not in text
