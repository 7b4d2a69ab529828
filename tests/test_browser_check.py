"""The browser check fails on each planted defect, and passes the same pages without them.

The pages are tiny hand-written HTML in a temporary folder, so this needs no book build, only
Debian's chromium and the playwright package (`make browser-check` installs both; elsewhere the
test is skipped unless MINIPAGED_REQUIRE_BROWSER is set, as it is in that target).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import browser_check  # noqa: E402

REQUIRED = bool(os.environ.get("MINIPAGED_REQUIRE_BROWSER"))
if not REQUIRED:
    pytest.importorskip("playwright.sync_api")
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("Debian's chromium is not installed", allow_module_level=True)

PNG = bytes.fromhex(  # a 1x1 PNG
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5ddc2a80000000049454e44ae426082")

CLEAN = {
    "image": '<img src="../_images/plot.png" alt="a bar chart of memory use">',
    "math": "<p>The cache grows as n tokens.</p>",
    "table": "<table><tr><th></th><th>study</th><th>minipaged</th></tr>"
             "<tr><td>bytes</td><td>12 KiB</td><td>12 KiB</td></tr></table>",
    "script": "",
    "colab": '<a href="https://colab.research.google.com/github/x/y/blob/main/chapters/'
             '01_demo.ipynb">Colab</a>',
    "link": '<a href="../index.html#top">home</a>',
    "code": '<div class="cell_input"><pre>x = 1</pre></div>',
    "alt": "",
}
PLANTED = {
    "image": ('<img src="../_images/missing.png" alt="a plot">', "broken image"),
    "math": (r"<p>The cache is \(2 \times n\) bytes.</p>", "raw TeX"),
    "table": ('<div class="cell_output"><table><tr><td style="white-space: nowrap">'
              + "quantity " * 60 + "</td></tr></table></div>", "wider than the column"),
    "code": ('<div class="cell_input"><pre style="white-space: pre; overflow-x: auto">'
             + "x = 1; " * 40 + "</pre></div>", "code cell(s) wider than the page"),
    "alt": ('<img src="../_images/plot.png" alt="0f3a9c2b7d1e4a5b6c7d8e9f">', "without alt text"),
    "script": ("<script>console.error('boom')</script>", "console error"),
    "colab": ("", "no Colab link"),
    "link": ('<a href="../missing.html">nowhere</a>', "broken link"),
}


def write_book(root: Path, **parts: str) -> None:
    """A two-page book: an index and one chapter built from CLEAN, with `parts` swapped in."""
    body = {**CLEAN, **parts}
    (root / "chapters").mkdir(parents=True)
    (root / "_images").mkdir()
    (root / "_images" / "plot.png").write_bytes(PNG)
    (root / "index.html").write_text(
        '<html><body><main id="top"><a href="chapters/01_demo.html">chapter</a></main>'
        '</body></html>')
    (root / "chapters" / "01_demo.html").write_text(f"""<html><head>
<style>article {{ width: 600px; }}</style>{body['script']}</head><body><article>
<section id="demo"><h1>1. Demo</h1>{body['colab']}{body['image']}{body['math']}{body['link']}
{body['code']}{body['alt']}
<section id="what-we-measured"><h2>What we measured</h2>{body['table']}</section>
</section></article></body></html>""")


def check(root: Path, tmp_path: Path) -> list[str]:
    shots = tmp_path / "shots"
    browser_check.run(root, shots, install=False)
    import json
    return json.loads((shots / "report.json").read_text())["problems"]


def test_clean_pages_pass(tmp_path):
    write_book(tmp_path / "html")
    assert check(tmp_path / "html", tmp_path) == []
    assert (tmp_path / "shots" / "01_demo.png").stat().st_size > 0  # a screenshot was saved


@pytest.mark.parametrize("defect", sorted(PLANTED))
def test_each_planted_defect_fails(tmp_path, defect):
    html, expected = PLANTED[defect]
    write_book(tmp_path / "html", **{defect: html})
    problems = check(tmp_path / "html", tmp_path)
    assert any(expected in p for p in problems), problems


def test_text_table_is_not_a_table(tmp_path):
    """A fixed-width text table that fits still fails: the section needs a real table."""
    write_book(tmp_path / "html", table="<pre>bytes  12 KiB  12 KiB</pre>")
    assert any("no real table" in p for p in check(tmp_path / "html", tmp_path))


def test_long_code_lines_are_found_without_a_browser(tmp_path):
    """The static half of the width check: code lines, not YAML options or prose, are measured."""
    long = "x = " + "1 + " * 30 + "1"
    (tmp_path / "01_demo.md").write_text(
        "Prose may run long: " + "words " * 40 + "\n"
        "```{code-cell} ipython3\n---\nmystnb:\n  figure:\n    caption: \"" + "c" * 150 + "\"\n"
        "---\nshort = 1\n" + long + "\n```\n")
    problems = browser_check.long_code_lines(tmp_path)
    assert len(problems) == 1 and "01_demo.md:9" in problems[0], problems
