"""The built documentation site renders: no Sphinx/RST markup left, maths typeset, refs resolved.

The site is built once per test session (shared by the xdist workers) with
``mkdocs build --strict`` (about 3 s of CPU) into a temporary folder: ``--strict`` already
fails on a cross-reference that does not resolve or a docstring that does not parse; the
checks below catch what a strict build lets through because it is
valid Markdown that renders as raw text: Sphinx roles (``:func:`x` ``), RST directives
(``.. math::``), RST literal blocks and tables, ``$`` maths that ``pymdownx.arithmatex`` did not
pick up, and any script, style sheet or font loaded from another site at view time.
Set ``QM_DOCS_SITE=path`` to check an already built site instead (e.g. ``site`` after
``make docs``).
"""

from __future__ import annotations

import html
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

# Markup that renders as literal text when Sphinx/RST docstrings go through Markdown.
ROLE = re.compile(
    r":(?:py:)?(?:func|class|meth|attr|data|const|mod|obj|exc|ref|math|term|doc|any|envvar)"
    r":(?:`|<code>)"
)
DIRECTIVE = re.compile(r"\.\.\s+[A-Za-z][\w-]*::")
LITERAL_BLOCK = re.compile(r"::\s*$", re.M)  # RST "Example::" before an indented block
RST_TABLE = re.compile(r"={3,}[ \t]+={3,}")  # simple-table borders
RST_LINK = re.compile(r"</code>_|`_")  # `text <url>`_
RST_HEADING = re.compile(r"(?:^|\n)\s*[-=~^]{4,}\s*(?:\n|$)")  # an underline left as text
MD_REF = re.compile(r"\[[^\]\n]+\]\[[^\]\n]*\]")  # [title][identifier] that did not resolve
ATTR_LIST = re.compile(r"\{:?\s*[#.][\w-]+\s*\}")  # "{ #id }" that attr_list did not consume
EXTERNAL_ASSET = re.compile(
    r"<(?:script|img|iframe)\b[^>]*\bsrc=\"(?:https?:)?//|"
    r"<link\b[^>]*\bhref=\"(?:https?:)?//[^\"]*\"[^>]*>"
)


def _html_path(page: str) -> str:
    stem = page[: -len(".md")]
    return "index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html"


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
    given = os.environ.get("QM_DOCS_SITE")
    if given:
        return (ROOT / given).resolve()
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    from filelock import FileLock

    # One build per test session, shared by the pytest-xdist workers of this run (their base
    # temp folders have a common parent, which outlives the run: the folder is named after the
    # run, so a site built by an earlier run, or from another checkout, is never reused); the
    # first worker builds, the others wait and reuse it.
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if uid is None:  # no xdist: this process's own folder
        shared = tmp_path_factory.mktemp("docs-site-run")
        uid = "local"
    else:
        shared = tmp_path_factory.getbasetemp().parent
    out = shared / f"docs-site-{uid}"
    with FileLock(str(shared / f"docs-site-{uid}.lock")):
        if not (out / "index.html").is_file():
            env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
            proc = subprocess.run(
                [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                 "-f", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
            )
            assert proc.returncode == 0, (
                f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
            )
    return out


def _content(page_html: str) -> str:
    """The page's main article, as HTML."""
    m = re.search(r'<article class="md-content__inner[^"]*">(.*?)</article>', page_html, re.S)
    assert m, "no article in page"
    return m.group(1)


def _prose(article: str) -> str:
    """Text of the article outside code, maths, scripts and tags (entities decoded)."""
    text = re.sub(r"<(script|style|pre|code)\b.*?</\1>", " ", article, flags=re.S)
    text = re.sub(r'<(span|div) class="arithmatex">.*?</\1>', " ", text, flags=re.S)
    text = re.sub(r"<br\s*/?>|</p>|</li>|</td>|</th>|</h\d>|</div>", "\n", text)
    text = re.sub(r"<[^>]+>", "", text)
    return html.unescape(text)


def _problems(page_html: str) -> list[str]:
    article = _content(page_html)
    prose = _prose(article)
    found = []
    for what, rx, where in [
        ("Sphinx role", ROLE, article),
        ("RST directive", DIRECTIVE, prose),
        ("RST literal block '::'", LITERAL_BLOCK, prose),
        ("RST table border", RST_TABLE, prose),
        ("RST link", RST_LINK, article),
        ("RST heading underline / unparsed section", RST_HEADING, prose),
        ("unresolved cross-reference", MD_REF, prose),
        ("attribute list left as text", ATTR_LIST, prose),
    ]:
        for m in rx.finditer(where):
            line = where[max(0, m.start() - 60): m.end() + 60].replace("\n", " ")
            found.append(f"{what}: …{line}…")
    if "<autoref" in article:
        found.append("unresolved <autoref> tag")
    for m in re.finditer(r"\$", prose):
        found.append(f"unprocessed $ maths: …{prose[max(0, m.start() - 60): m.end() + 60]}…")
    for m in EXTERNAL_ASSET.finditer(page_html):
        found.append(f"asset fetched from another site at view time: {m.group(0)[:160]}")
    return found


@pytest.mark.parametrize("page", PAGES)
def test_page_renders(site, page):
    path = site / _html_path(page)
    assert path.is_file(), f"{page} was not built to {path}"
    problems = _problems(path.read_text(encoding="utf-8"))
    assert not problems, f"{page}: {len(problems)} rendering problem(s):\n" + "\n".join(
        problems[:40]
    )


def test_maths_typeset_locally(site):
    """Display maths reach MathJax, and MathJax (script and fonts) ships with the site."""
    page = (site / _html_path("derivations.md")).read_text(encoding="utf-8")
    assert re.search(r'<div class="arithmatex">\\\[.+?\\\]</div>', page, re.S)
    assert re.search(r'<span class="arithmatex">\\\(.+?\\\)</span>', page, re.S)
    scripts = re.findall(r'<script src="([^"]+)"', page)
    mathjax = [s for s in scripts if s.endswith("tex-chtml-full.js")]
    assert mathjax, scripts
    assert (site / "derivations" / mathjax[0]).resolve().is_file()
    fonts = site / "assets/mathjax/output/chtml/fonts/woff-v2"
    assert len(list(fonts.glob("*.woff"))) >= 20


def test_checker_catches_raw_markup():
    """The checks above fail on the markup they look for (and pass on rendered output)."""
    wrap = '<html><article class="md-content__inner md-typeset">{}</article></html>'
    bad = [
        "<p>as in :func:<code>geodesic_sharpness</code></p>",
        "<p>.. math::</p><p>x^2</p>",
        "<p>Schema::</p>",
        "<p>===== =====</p>",
        "<p>the maths $$ x $$ stays raw</p>",
        "<p>see [GLQuotient][quotient_manifolds.nowhere]</p>",
        "<p><strong>Title</strong> { #title }</p>",
        '<p><a href="https://x.org">x</a></p><script src="https://cdn.x/mj.js"></script>',
    ]
    for snippet in bad:
        assert _problems(wrap.format(snippet)), snippet
    good = (
        '<p>as in <a href="#x"><code>geodesic_sharpness</code></a>, '
        '<span class="arithmatex">\\(x^2\\)</span>, <code>a[b][c]</code> and</p>'
        '<div class="arithmatex">\\[\\sum_i x_i\\]</div><pre><code>$ pip install x\n'
        ".. math::</code></pre>"
    )
    assert _problems(wrap.format(good)) == []
