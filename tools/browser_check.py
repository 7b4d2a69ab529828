"""Open every page of the built book in headless Chromium, as a reader would, and fail on defects.

    python -m tools.browser_check [_build/html] [--screenshots _build/screenshots]

Each page is served from a local HTTP server on 127.0.0.1 and loaded with every request to any
other host blocked, so the book is read as it would be offline. A page fails on:

- a broken image (not loaded, or zero pixels wide);
- raw TeX: a math element that MathJax did not typeset, or TeX delimiters left in the text;
- a table in the "What we measured" section wider than the text column at 1280 px, or a
  chapter whose "What we measured" section has no real table;
- a console error, an uncaught exception, or a failed request to the book's own files;
- a chapter page without its Colab link (to the chapter's own notebook);
- a code cell wider than the page at 1280 px, or a chapter code line over 100 columns;
- any other table of a chapter (a vLLM map, say) wider than the box that holds it, so that part
  of it hides behind a sideways scroll;
- a word of a table's header (outside code spans), on any page, drawn on two lines, "thr/ea/ds";
- an image without real alt text (none, or an image hash);
- a code cell that shows its `#| export` line (book/_static/minipaged.js hides them);
- a broken internal link (to a page or file that is not in the build, or to a missing anchor);
- a step player (minipaged.player) whose controls do not show, or that does not move to the step
  its slider, its Next button, the arrow keys on a focused control, or the arrow keys after a
  click on its picture ask for; a page with a player whose HTML weighs over 2 MiB;
- at a phone's width (420 px), a step player wider than the screen, or whose picture's smallest
  text is drawn under 9 px (it must keep a legible size and scroll sideways instead).

Screenshots of each chapter (its top, its "What we measured" section, and each step player at
the step it opens on) go to the screenshot folder, for CI to keep as artifacts. The browser is
Debian's `chromium`, driven by playwright (the Python package only: no browser is downloaded).
When `chromium` is missing the script installs it with apt-get, as CI runs as root.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

WIDTH, HEIGHT = 1280, 900
# A phone's width, and the smallest text a step player's picture may be drawn at there: its
# pictures' smallest font is 11 units of their viewBox (the blocks' numbers).
NARROW_WIDTH, MIN_PLAYER_TEXT_PX, PLAYER_SMALLEST_FONT = 420, 9, 11
# Columns of code a chapter code cell shows without scrolling at 1280 px
# (book/_static/minipaged.css sets the code font so that ruff's 100 columns fit).
CODE_COLUMNS = 100
# A page that carries step players (every step's picture is in its HTML) stays under this.
PLAYER_PAGE_MIB, MiB = 2, 2**20
CHAPTER_PAGE = re.compile(r"^chapters/\d\d_[a-z0-9_]+\.html$")
# Text that only appears when TeX was not turned into math.
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\(?:frac|text|times|mathrm|left|right|lfloor|"
                     r"rfloor|cdot|sum|le|ge)\b")

# Runs in the page once it has loaded and MathJax (if any) has finished typesetting.
PAGE_PROBE = r"""
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    try { await MathJax.startup.promise; } catch (e) {}
  }
  for (const img of document.images) { img.loading = "eager"; }
  await Promise.all(Array.from(document.images).map(img => img.complete ? null :
    new Promise(done => { img.onload = img.onerror = done; setTimeout(done, 5000); })));
  const skip = "pre, code, script, style, textarea, mjx-container, .highlight";
  const rawTex = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walker.nextNode()) {
    const node = walker.currentNode;
    if (node.parentElement && !node.parentElement.closest(skip) && node.textContent.trim()) {
      rawTex.push(node.textContent.trim().slice(0, 200));
    }
  }
  const untypeset = Array.from(document.querySelectorAll(".math"))
    .filter(el => !el.querySelector("mjx-container") && !el.closest("pre, code"))
    .map(el => el.textContent.trim().slice(0, 120));
  const brokenImages = Array.from(document.images)
    .filter(img => !img.complete || img.naturalWidth === 0)
    .map(img => img.getAttribute("src"));
  const imagesWithoutAlt = Array.from(document.querySelectorAll("main img, article img"))
    .filter(img => !(img.getAttribute("alt") || "").trim() || /^[0-9a-f]{16,}/.test(img.alt))
    .map(img => img.getAttribute("src"));
  const heading = Array.from(document.querySelectorAll("h2"))
    .find(h => /what we measured/i.test(h.textContent));
  let measured = null;
  if (heading) {
    const section = heading.closest("section") || heading.parentElement;
    const column = (document.querySelector("article") || section).getBoundingClientRect();
    const tables = Array.from(section.querySelectorAll("table"));
    const wide = [];
    // What a reader sees: tables and outputs (folded code cells are not shown, not measured).
    const shown = "table, .cell_output pre, .output pre, .cell_output";
    for (const el of section.querySelectorAll(shown)) {
      if (el.closest(".cell_input") || (el.checkVisibility && !el.checkVisibility())) continue;
      const box = el.getBoundingClientRect();
      if (box.right > column.right + 1 || el.scrollWidth > el.clientWidth + 1) {
        wide.push(`${el.tagName.toLowerCase()}.${el.className}: ${Math.round(box.width)} px` +
                  ` (scroll ${el.scrollWidth} > ${el.clientWidth}),` +
                  ` column ${Math.round(column.width)} px`);
      }
    }
    measured = {tables: tables.length, wide: wide, id: section.id || ""};
  }
  // A table header's word drawn on two lines ("thr/ea/ds"): its column was made narrower than
  // the word. Names in code spans may wrap (a long path must); words of four letters or more.
  function brokenHeaderWords() {
    const broken = [];
    for (const th of document.querySelectorAll("article table th")) {
      if (th.closest(".cell_input")) continue;
      const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT, {acceptNode: node =>
        node.parentElement.closest("code") ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT});
      for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (const word of node.data.matchAll(/[A-Za-z][A-Za-z'’]{3,}/g)) {
          const range = document.createRange();
          range.setStart(node, word.index);
          range.setEnd(node, word.index + word[0].length);
          const lines = new Set(Array.from(range.getClientRects(), r => Math.round(r.top)));
          if (lines.size > 1) broken.push(word[0]);
        }
      }
    }
    return broken;
  }
  const overflowing = sel => Array.from(document.querySelectorAll(sel))
    .filter(el => el.scrollWidth > el.clientWidth + 1).length;
  return {
    rawTex, untypeset, brokenImages, imagesWithoutAlt, measured,
    links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
    ids: Array.from(document.querySelectorAll("[id]")).map(el => el.id)
      .concat(Array.from(document.querySelectorAll("a[name]")).map(a => a.name)),
    colab: Array.from(document.querySelectorAll("a[href*='colab.research.google.com']"))
      .map(a => a.href),
    codeCells: document.querySelectorAll(".cell_input pre").length,
    directivesShown: Array.from(document.querySelectorAll(".cell_input pre"))
      .filter(pre => /^\s*#\|/.test(pre.textContent)).length,
    wideCode: overflowing(".cell_input pre"),
    wideTables: Array.from(document.querySelectorAll("article table"))
      .filter(t => !t.closest(".cell_input") && t.parentElement
                   && t.scrollWidth > t.parentElement.clientWidth + 1)
      .map(t => t.textContent.trim().replace(/\s+/g, " ").slice(0, 60)),
    brokenHeaders: brokenHeaderWords(),
    outputs: document.querySelectorAll(".cell_output pre").length,
    wideOutputs: overflowing(".cell_output pre"),
  };
}
"""


@dataclass
class PageReport:
    """What one page showed; `problems` is empty when the page passes."""

    path: str
    problems: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    players: int = 0  # step players on the page


def find_chromium(install: bool = True) -> str:
    """The path of Debian's chromium, installed with apt-get when missing (and allowed)."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if not install:
        raise SystemExit("chromium is not installed (apt-get install chromium)")
    print("browser-check: installing Debian's chromium with apt-get", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    # fonts-liberation: the theme's monospace font, which the code-width check measures with.
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium", "fonts-liberation"],
                   check=True, env=env, stdout=subprocess.DEVNULL)
    path = shutil.which("chromium")
    if not path:
        raise SystemExit("apt-get did not install chromium")
    return path


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would drown the report
        pass


def serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """Serve root on a free port of 127.0.0.1; returns the server and its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def pages_of(root: Path) -> list[str]:
    """Every HTML page of the build, relative to root, skipping Sphinx's own generated ones."""
    skip = {"genindex.html", "search.html", "py-modindex.html"}
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.html")
                  if p.relative_to(root).parts[0] not in {"_static", "_sources", "_images"}
                  and p.name not in skip and not _is_redirect(p))


def _is_redirect(path: Path) -> bool:
    """A stub that only sends the browser elsewhere (the book's index.html is one)."""
    head = path.read_text(errors="replace")[:500].lower()
    return 'http-equiv="refresh"' in head and "<body" not in head


def last_pages(paths: list[str]) -> set[str]:
    """The last page of each chapter among the book's pages: a chapter may span several
    (07_scheduler, 07_the_llm, 07_under_load), and only its last one ends with what it measured."""
    chapters = sorted(path for path in paths if CHAPTER_PAGE.match(path))
    return set({posixpath.basename(path)[:2]: path for path in chapters}.values())


# The step a player shows, its step count, and whether its controls are on the page.
PLAYER_STATE = r"""
root => ({
  shown: Array.from(root.querySelectorAll(".mp-frame")).findIndex(f => !f.hidden),
  frames: root.querySelectorAll(".mp-frame").length,
  controls: !root.querySelector(".mp-controls").hidden,
  says: (root.querySelector(".mp-frame:not([hidden])") || {}).textContent || "",
})
"""


def check_players(page, screenshots: Path | None, stem: str) -> list[str]:
    """Drive every step player on the page as a reader would: the slider, the Next button,
    and the keyboard alone (arrow keys on a focused control, Enter on a button). Each must
    show the step asked for, and another picture; a screenshot of each at its opening step."""
    problems = []
    for number, root in enumerate(page.query_selector_all(".mp-player"), 1):
        name = f"player {number}"
        root.scroll_into_view_if_needed()
        first = root.evaluate(PLAYER_STATE)
        if first["frames"] < 2 or first["shown"] < 0:
            problems.append(f"{name}: {first['frames']} step(s), {first['shown']} shown")
            continue
        if not first["controls"]:
            problems.append(f"{name}: its controls are not shown (did its script run?)")
            continue
        if screenshots is not None:
            root.screenshot(path=str(screenshots / f"{stem}_player{number}.png"))
        last, seen = first["frames"] - 1, [first]
        target = 0 if first["shown"] else last
        root.eval_on_selector(".mp-slider", "(s, v) => { s.value = v; "
                              "s.dispatchEvent(new Event('input', {bubbles: true})); }", target)
        expected = [target]
        seen.append(root.evaluate(PLAYER_STATE))
        start = seen[-1]["shown"]
        root.query_selector(".mp-next" if start < last else ".mp-prev").click()
        expected.append(start + 1 if start < last else start - 1)
        seen.append(root.evaluate(PLAYER_STATE))
        root.query_selector(".mp-next").focus()  # the keyboard alone from here on
        key, step = ("ArrowLeft", -1) if seen[-1]["shown"] > 0 else ("ArrowRight", 1)
        page.keyboard.press(key)
        expected.append(seen[-1]["shown"] + step)
        seen.append(root.evaluate(PLAYER_STATE))
        button, step = (".mp-next", 1) if seen[-1]["shown"] < last else (".mp-prev", -1)
        root.query_selector(button).focus()
        page.keyboard.press("Enter")
        expected.append(seen[-1]["shown"] + step)
        seen.append(root.evaluate(PLAYER_STATE))
        page.evaluate("() => document.activeElement && document.activeElement.blur()")
        root.query_selector(".mp-frame:not([hidden]) svg").click()  # the picture, not a control
        key, step = ("ArrowLeft", -1) if seen[-1]["shown"] > 0 else ("ArrowRight", 1)
        page.keyboard.press(key)
        expected.append(seen[-1]["shown"] + step)
        seen.append(root.evaluate(PLAYER_STATE))
        moves = ("slider", "Next/Previous", key, "Enter", f"{key} after a click on its picture")
        for move, want, before, after in zip(moves, expected, seen, seen[1:]):
            if after["shown"] != want or after["says"] == before["says"]:
                problems.append(f"{name}: {move} showed step {after['shown']}, not step {want}"
                                if after["shown"] != want else
                                f"{name}: {move} left the picture as it was")
    return problems


# A player at a phone's width: its box against the screen's, and the scale of its picture.
PLAYER_NARROW = r"""
root => {
  const frame = root.querySelector(".mp-frame:not([hidden])"), svg = frame.querySelector("svg");
  const box = svg.getBoundingClientRect();  /* a scrolling frame clips the picture */
  const right = Math.max(root.getBoundingClientRect().right, frame.getBoundingClientRect().right);
  return {right: right, screen: document.documentElement.clientWidth,
          scale: box.width / svg.viewBox.baseVal.width};
}
"""


def check_players_narrow(page) -> list[str]:
    """At NARROW_WIDTH px, every player fits the screen and draws its text at a legible size."""
    problems = []
    page.set_viewport_size({"width": NARROW_WIDTH, "height": HEIGHT})
    try:
        page.wait_for_timeout(100)  # the layout at the new width
        for number, root in enumerate(page.query_selector_all(".mp-player"), 1):
            found = root.evaluate(PLAYER_NARROW)
            text_px = PLAYER_SMALLEST_FONT * found["scale"]
            if found["right"] > found["screen"] + 1:
                problems.append(f"player {number}: {found['right']:.0f} px wide at "
                                f"{NARROW_WIDTH} px, wider than the screen")
            if text_px < MIN_PLAYER_TEXT_PX:
                problems.append(f"player {number}: its smallest text is {text_px:.1f} px at "
                                f"{NARROW_WIDTH} px, under {MIN_PLAYER_TEXT_PX} px (unreadable)")
    finally:
        page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    return problems


def check_page(page, base: str, path: str, screenshots: Path | None,
               last_page: bool = True) -> PageReport:
    """Load one page and return what it showed."""
    report = PageReport(path)
    messages: list[str] = []
    page.on("console", lambda msg: messages.append(f"console {msg.type}: {msg.text}")
            if msg.type == "error" else None)
    page.on("pageerror", lambda error: messages.append(f"uncaught: {error}"))
    page.on("requestfailed", lambda request: messages.append(
        f"request failed: {request.url} ({request.failure})")
        if request.url.startswith(base) else None)
    page.on("response", lambda response: messages.append(
        f"HTTP {response.status}: {response.url}")
        if response.url.startswith(base) and response.status >= 400 else None)
    page.goto(base + path, wait_until="load")
    result = page.evaluate(PAGE_PROBE)
    page.wait_for_timeout(200)  # late console messages
    num_messages = len(messages)
    report.problems += messages[:num_messages]
    report.problems += [f"broken image: {src}" for src in result["brokenImages"]]
    report.problems += [f"image without alt text: {src}" for src in result["imagesWithoutAlt"]]
    report.problems += [f"math not typeset: {text}" for text in result["untypeset"]]
    report.problems += [f"raw TeX in text: {text!r}" for text in result["rawTex"]
                        if RAW_TEX.search(text)]
    report.problems += [f"a table header's word broken across lines: {word!r}"
                        for word in result["brokenHeaders"]]  # every page's tables
    chapter = CHAPTER_PAGE.match(path)
    if chapter and result["directivesShown"]:
        report.problems.append(f"{result['directivesShown']} code cell(s) show their #| lines")
    if chapter and result["wideCode"]:
        report.problems.append(
            f"{result['wideCode']} code cell(s) wider than the page at {WIDTH} px")
    if chapter:
        report.problems += [f"table wider than the text column at {WIDTH} px: {text!r}"
                            for text in result["wideTables"]]
        notebook = Path(path).with_suffix(".ipynb").name
        if not any(notebook in href for href in result["colab"]):
            report.problems.append(f"no Colab link to {notebook}")
        measured = result["measured"]
        if measured is None and last_page:
            report.problems.append("no 'What we measured' section")
        elif measured is not None:
            if measured["tables"] == 0:
                report.problems.append("'What we measured' has no real table")
            report.problems += [f"'What we measured' wider than the column: {w}"
                                for w in measured["wide"]]
    report.problems += check_players(page, screenshots if chapter else None, Path(path).stem)
    report.players = len(page.query_selector_all(".mp-player"))
    if report.players:
        report.problems += check_players_narrow(page)
    page.wait_for_timeout(100)
    report.problems += messages[num_messages:]  # console errors the players caused
    report.ids = set(result["ids"])
    report.links = result["links"]
    report.stats = {key: result[key] for key in ("codeCells", "wideCode", "outputs", "wideOutputs")}
    if screenshots is not None and chapter:
        stem = Path(path).stem
        page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        page.screenshot(path=str(screenshots / f"{stem}.png"))
        if measured is not None and measured["id"]:
            # The window as a reader sees it, scrolled to the closing table.
            page.evaluate("id => document.getElementById(id).scrollIntoView()", measured["id"])
            page.wait_for_timeout(200)
            page.screenshot(path=str(screenshots / f"{stem}_measured.png"))
    return report


def check_links(root: Path, base: str, reports: dict[str, PageReport]) -> list[str]:
    """Internal links whose target page, file or anchor is missing from the build."""
    problems = []
    for path, report in reports.items():
        for href in report.links:
            if not href.startswith(base):
                continue  # another host: the check never leaves this machine
            parsed = urllib.parse.urlsplit(href[len(base):])
            target = posixpath.normpath(urllib.parse.unquote(parsed.path) or "index.html")
            if target.endswith("/") or (root / target).is_dir():
                target = posixpath.join(target, "index.html")
            if not (root / target).is_file():
                problems.append(f"{path}: broken link to {target}")
            elif parsed.fragment and target in reports and \
                    urllib.parse.unquote(parsed.fragment) not in reports[target].ids:
                problems.append(f"{path}: link to missing anchor {target}#{parsed.fragment}")
    return problems


def long_code_lines(chapters: Path, limit: int = CODE_COLUMNS) -> list[str]:
    """Lines of the chapters' code cells longer than the page shows at 1280 px (no browser)."""
    problems = []
    for source in sorted(chapters.glob("*.md")):
        in_cell = in_options = False
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if line.startswith("```{code-cell}"):
                in_cell, in_options = True, False
            elif in_cell and line == "```":
                in_cell = False
            elif in_cell and line == "---":
                in_options = not in_options  # the cell's YAML options, not code
            elif in_cell and not in_options and len(line) > limit:
                problems.append(f"{source.name}:{number}: code line of {len(line)} columns "
                                f"(the page shows {limit})")
    return problems


def run(root: Path, screenshots: Path | None, install: bool = True,
        chapters: Path | None = None) -> int:
    """Check every page under root; print a report; return the number of problems."""
    from playwright.sync_api import sync_playwright

    root = root.resolve()
    if not (root / "index.html").is_file():
        raise SystemExit(f"{root} has no index.html: build the book first (make book)")
    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
    executable = find_chromium(install)
    server, base = serve(root)
    reports: dict[str, PageReport] = {}
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=executable,
                                                 args=["--no-sandbox", "--disable-gpu"])
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
            # Offline: anything not served by the book itself is refused.
            context.route(re.compile(r"^(?!" + re.escape(base) + ").*"),
                          lambda route: route.abort("internetdisconnected"))
            paths = list(pages_of(root))
            last = last_pages(paths)
            for path in paths:
                page = context.new_page()
                try:
                    reports[path] = check_page(page, base, path, screenshots, path in last)
                finally:
                    page.close()
            browser.close()
    finally:
        server.shutdown()
    problems = [f"{path}: {p}" for path, r in reports.items() for p in r.problems]
    problems += [f"{path}: a page with a step player weighs {size / MiB:.1f} MiB, over "
                 f"{PLAYER_PAGE_MIB} MiB" for path, r in reports.items() if r.players
                 for size in [(root / path).stat().st_size] if size > PLAYER_PAGE_MIB * MiB]
    problems += check_links(root, base, reports)
    if chapters is not None and chapters.is_dir():
        problems += long_code_lines(chapters)
    totals = {key: sum(r.stats.get(key, 0) for r in reports.values())
              for key in ("codeCells", "wideCode", "outputs", "wideOutputs")}
    print(f"browser-check: {len(reports)} pages at {WIDTH} px; code cells wider than the page "
          f"{totals['wideCode']} of {totals['codeCells']}, outputs {totals['wideOutputs']} of "
          f"{totals['outputs']}")
    for problem in problems:
        print("  FAIL", problem)
    if screenshots is not None:
        print(f"browser-check: screenshots in {screenshots}")
    summary = {"pages": len(reports), "problems": problems, **totals}
    if screenshots is not None:
        (screenshots / "report.json").write_text(json.dumps(summary, indent=1))
    print(f"browser-check: {len(problems)} problem(s)" if problems
          else "browser-check: all pages pass")
    return len(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", nargs="?", default="_build/html", type=Path)
    parser.add_argument("--screenshots", default="_build/screenshots", type=Path)
    parser.add_argument("--chapters", default="chapters", type=Path,
                        help="the chapters' sources, whose code lines are held to the page width")
    parser.add_argument("--no-install", action="store_true",
                        help="fail instead of installing chromium with apt-get")
    parser.add_argument("--install-only", action="store_true",
                        help="install chromium when missing, check nothing")
    args = parser.parse_args(argv)
    if args.install_only:
        print(f"browser-check: chromium at {find_chromium(install=True)}")
        return 0
    return 1 if run(args.root, args.screenshots, install=not args.no_install,
                    chapters=args.chapters) else 0


if __name__ == "__main__":
    sys.exit(main())
