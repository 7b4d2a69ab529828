"""The browser check fails on each planted defect, and passes the same page without them.

The pages are tiny hand-written HTML in a temporary folder, so this needs no book build, only
Debian's chromium and the playwright package (`make browser-check` installs both; elsewhere the
test is skipped unless MINIPAGED_REQUIRE_BROWSER is set, as it is in that target). One fixture
book holds a clean chapter and one chapter per defect, so the browser starts once.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from minipaged.blocks import BlockPool, BlockTable  # noqa: E402
from minipaged.player import StepRecorder, show_steps  # noqa: E402
from tools import browser_check

pytestmark = pytest.mark.heavy  # starts a browser

PNG = bytes.fromhex(  # a 1x1 PNG
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5ddc2a80000000049454e44ae426082")

CLEAN = {
    "image": '<img src="../_images/plot.png" alt="a bar chart of memory use">',
    "math": "<p>The cache grows as n tokens.</p>",
    "table": "<table><tr><th></th><th>study</th><th>minipaged</th></tr>"
             "<tr><td>bytes</td><td>12 KiB</td><td>12 KiB</td></tr></table>",
    "script": "",
    "colab": True,
    "link": '<a href="../index.html#top">home</a>',
    "code": '<div class="cell_input"><pre>x = 1</pre></div>',
    "alt": "",
    "map": '<div class="admonition"><div style="overflow-x: auto"><table><tr><td>minipaged</td>'
           '<td>vLLM</td></tr></table></div></div>',
}
# defect: (what replaces the clean part, words the report must contain)
PLANTED = {
    "image": ('<img src="../_images/missing.png" alt="a plot">', "broken image"),
    "math": (r"<p>The cache is \(2 \times n\) bytes.</p>", "raw TeX"),
    "table": ('<div class="cell_output"><table><tr><td style="white-space: nowrap">'
              + "quantity " * 60 + "</td></tr></table></div>", "wider than the column"),
    "text_table": ("<pre>bytes  12 KiB  12 KiB</pre>", "no real table"),
    "script": ("<script>console.error('boom')</script>", "console error"),
    "colab": (False, "no Colab link"),
    "link": ('<a href="../missing.html">nowhere</a>', "broken link"),
    "code": ('<div class="cell_input"><pre style="white-space: pre; overflow-x: auto">'
             + "x = 1; " * 40 + "</pre></div>", "code cell(s) wider than the page"),
    "alt": ('<img src="../_images/plot.png" alt="0f3a9c2b7d1e4a5b6c7d8e9f">', "without alt text"),
    "directive": ('<div class="cell_input"><pre>#| export\nx = 1</pre></div>', "#| lines"),
    "map": ('<div class="admonition"><div style="overflow-x: auto"><table><tr>'
            '<td style="white-space: nowrap">' + "vllm/v1/core/kv_cache_utils.py " * 12
            + "</td></tr></table></div></div>", "table wider than the text column"),
    "header": ('<table><tr><th style="overflow-wrap: anywhere; width: 2em">preemptions</th>'
               '<th>study</th></tr><tr><td>0</td><td>12 KiB</td></tr></table>',
               "header's word broken across lines: 'preemptions'"),
}


def player_page() -> str:
    """A step player as a chapter writes it: three tables taking blocks, one giving them back."""
    pool, tables = BlockPool(num_blocks=6, block_size=4), {}
    recorder = StepRecorder(pool, tables)
    recorder.record("an empty pool")
    for name in "ABC":
        tables[name] = BlockTable(pool)
        tables[name].ensure_capacity(5)
        recorder.record()
    tables.pop("A").free()
    recorder.record()
    return show_steps(recorder.trace, start=2, caption="a player", alt="a pool")._repr_html_()


CLEAN["player"] = player_page()
PLANTED["player"] = (CLEAN["player"].split("<script>")[0], "controls are not shown")
PLANTED["player_stuck"] = (CLEAN["player"].replace("show(current + d)", "show(current)")
                           .replace("show(Number(slider.value))", "show(current)"),
                           "Next/Previous showed step")
PLANTED["player_heavy"] = (CLEAN["player"] + "<!--" + "x" * (2 * 2**20) + "-->", "MiB")
PLANTED["player_no_focus"] = (CLEAN["player"].replace(' tabindex="0"', ""),
                              "after a click on its picture showed step")
PLANTED["player_tiny"] = (CLEAN["player"].replace("min-width: 600px", "min-width: 0"),
                          "unreadable")
PLANTED["player_wide"] = (CLEAN["player"].replace(".mp-frame { overflow-x: auto; }",
                                                  ".mp-frame { width: 760px; }"),
                          "wider than the screen")
PAGES = ["clean"] + sorted(PLANTED)


def chapter(number: int, **parts) -> str:
    """One chapter page built from CLEAN, with `parts` swapped in."""
    body = {**CLEAN, **parts}
    stem = f"{number:02d}_demo"
    colab = (f'<a href="https://colab.research.google.com/github/x/y/blob/main/chapters/'
             f'{stem}.ipynb">Colab</a>' if body["colab"] else "")
    return f"""<html><head>
<style>article {{ max-width: 600px; }}</style>{body['script']}</head><body><article>
<section id="demo"><h1>{number}. Demo</h1>{colab}{body['image']}{body['math']}{body['link']}
{body['code']}{body['alt']}{body['player']}{body['map']}
<section id="what-we-measured"><h2>What we measured</h2>{body['table']}</section>
</section></article></body></html>"""


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> dict[str, list[str]]:
    """Run the checker once over a book of one clean chapter and one chapter per defect."""
    if not os.environ.get("MINIPAGED_REQUIRE_BROWSER"):
        pytest.importorskip("playwright.sync_api")
        if not (shutil.which("chromium") or shutil.which("chromium-browser")):
            pytest.skip("Debian's chromium is not installed")
    root = tmp_path_factory.mktemp("book") / "html"
    (root / "chapters").mkdir(parents=True)
    (root / "_images").mkdir()
    (root / "_images" / "plot.png").write_bytes(PNG)
    links = "".join(f'<a href="chapters/{n:02d}_demo.html">{n}</a>'
                    for n in range(1, 1 + len(PAGES)))
    (root / "index.html").write_text(f'<html><body><main id="top">{links}</main></body></html>')
    for number, name in enumerate(PAGES, 1):
        if name == "clean":
            html = chapter(number)
        else:
            part = "player" if name.startswith("player") else {
                "text_table": "table", "directive": "code", "header": "table"}.get(name, name)
            html = chapter(number, **{part: PLANTED[name][0]})
        (root / "chapters" / f"{number:02d}_demo.html").write_text(html)
    shots = root.parent / "shots"
    count = browser_check.run(root, shots, install=False)
    report = json.loads((shots / "report.json").read_text())["problems"]
    assert count == len(report)
    assert (shots / "01_demo.png").stat().st_size > 0  # a screenshot was saved
    assert (shots / "01_demo_player1.png").stat().st_size > 0  # and one of its player
    return {name: [p for p in report if p.startswith(f"chapters/{number:02d}_demo.html")]
            for number, name in enumerate(PAGES, 1)}


def test_clean_page_passes(problems):
    assert problems["clean"] == []


@pytest.mark.parametrize("defect", sorted(PLANTED))
def test_each_planted_defect_fails(problems, defect):
    expected = PLANTED[defect][1]
    assert any(expected in p for p in problems[defect]), problems[defect]


def test_long_code_lines_are_found_without_a_browser(tmp_path):
    """The static half of the width check: code lines, not YAML options or prose, are measured."""
    long = "x = " + "1 + " * 30 + "1"
    (tmp_path / "01_demo.md").write_text(
        "Prose may run long: " + "words " * 40 + "\n"
        "```{code-cell} ipython3\n---\nmystnb:\n  figure:\n    caption: \"" + "c" * 150 + "\"\n"
        "---\nshort = 1\n" + long + "\n```\n")
    problems = browser_check.long_code_lines(tmp_path)
    assert len(problems) == 1 and "01_demo.md:9" in problems[0], problems


def test_only_a_chapters_last_page_must_end_with_what_it_measured():
    pages = ["index.html", "chapters/05_paged_attention.html",
             "chapters/05_what_the_table_costs.html", "chapters/07_scheduler.html",
             "chapters/07_the_llm.html", "chapters/07_under_load.html",
             "chapters/08_prefix_caching.html", "book/api.html"]
    assert browser_check.last_pages(pages) == {
        "chapters/05_what_the_table_costs.html", "chapters/07_under_load.html",
        "chapters/08_prefix_caching.html"}
