"""Small fixes to the built book that configuration alone cannot make (issue 12).

- Every script is included once: sphinx-thebe registers its configuration script on each
  read of the sources, and two copies on a page raise "THEBE_JS_URL has already been declared".
- The theme starts in a named colour mode, so a first visit logs no "invalid theme mode" error.
- Each chapter's executed notebook (with its outputs, as the build ran it) is copied next to the
  pages, under _executed/, for the download link that minipaged.js adds to each chapter.
- A chapter executed by the build runs with MINIPAGED_CHAPTER naming it, so that the values it
  glues are recorded under its name in _build/measured/ for chapter 12's reproduction table.
- Chapter 12 reads those records, which its own code does not mention, so jupyter-cache would
  keep its page when only an earlier chapter re-ran. Before it is read, its cached execution is
  dropped if any other chapter's record is newer than it, and the build runs it again.
- The reference page's table of versions is made from requirements.lock at each build (issue 43).
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
from pathlib import Path

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _one_of_each_script(app, pagename, templatename, context, doctree) -> None:
    scripts, seen = [], set()
    for script in context.get("script_files", []):
        # An inline script is registered once with filename None and once with "": one script.
        filename = getattr(script, "filename", script) or ""
        key = (str(filename), tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            scripts.append(script)
    # In place: handlers that run later (MathJax's) add to this same list for this page.
    context["script_files"][:] = scripts


def _default_mode(app, config) -> None:
    context = dict(config.html_context or {})  # pydata-sphinx-theme reads it from the context
    context.setdefault("default_mode", "light")
    config.html_context = context


def _copy_executed_notebooks(app, exception) -> None:
    if exception is not None or app.builder.format != "html":
        return
    executed = Path(app.outdir).parent / "jupyter_execute" / "chapters"
    target = Path(app.outdir) / "_executed" / "chapters"
    if not executed.is_dir():
        logger.info("minipaged_book: no executed notebooks at %s", executed)
        return
    target.mkdir(parents=True, exist_ok=True)
    for notebook in sorted(executed.glob("*.ipynb")):
        shutil.copy2(notebook, target / notebook.name)


READS_THE_RECORDS = "chapters/12_what_it_bought"


def forget_stale_reckoning(root: Path) -> list[int]:
    """Drop chapter 12's cached executions older than another chapter's record; return their pks."""
    measured, cache_path = root / "_build" / "measured", root / "_build" / ".jupyter_cache"
    stamps = [p.stat().st_mtime for p in measured.glob("*.json")
              if not p.name.startswith(Path(READS_THE_RECORDS).name)]
    if not stamps or not cache_path.is_dir():
        return []
    from jupyter_cache import get_cache

    newest = datetime.datetime.fromtimestamp(max(stamps), datetime.timezone.utc)
    cache, dropped = get_cache(str(cache_path)), []
    for record in cache.list_cache_records():
        created = record.created if record.created.tzinfo else record.created.replace(
            tzinfo=datetime.timezone.utc)  # jupyter-cache stores UTC
        if Path(record.uri).stem == Path(READS_THE_RECORDS).name and created < newest:
            cache.remove_cache(record.pk)
            dropped.append(record.pk)
    return dropped


def _reread_reckoning(app, env, added, changed, removed) -> list[str]:
    # An incremental build re-reads only changed sources: chapter 12 must come along whenever
    # another chapter is read (and so may run and record), or its stale check never happens.
    others = {d for d in added | changed if d.startswith("chapters/") and d != READS_THE_RECORDS}
    return [READS_THE_RECORDS] if others and READS_THE_RECORDS in env.found_docs else []


def _name_the_chapter(app, docname, source) -> None:
    if docname == READS_THE_RECORDS and forget_stale_reckoning(Path(app.srcdir)):
        logger.info("minipaged_book: chapter 12 runs again: a chapter's record is newer")
    # MyST-NB executes a notebook while parsing it, just after this event: its kernel inherits
    # the variable. Reading is serial here (jupyter-book does not read in parallel).
    if docname.startswith("chapters/"):
        os.environ["MINIPAGED_CHAPTER"] = docname.removeprefix("chapters/")
    else:
        os.environ.pop("MINIPAGED_CHAPTER", None)


VLLM_VERSION = "{{ vllm_version }}"


def _vllm_version(app, docname, source) -> None:
    # The release the maps cite is written once, as _config.yml's vllm_version substitution.
    # MyST substitutes it in prose only; this puts it in code blocks and inline code as well
    # (the intro's download commands), before MyST reads the page.
    version = (getattr(app.config, "myst_substitutions", None) or {}).get("vllm_version")
    if version and VLLM_VERSION in source[0]:
        source[0] = source[0].replace(VLLM_VERSION, str(version))


LOCKED_VERSIONS = "<!-- locked versions -->"
# The packages whose versions the reference page shows, in this order.
SHOWN = ("torch", "triton", "transformers", "jupyter-book", "numpy")


def locked_versions_table(root: Path) -> str:
    """The reference page's table: each package of SHOWN at requirements.lock's version, beside
    the range requirements.txt allows (the lock is made from those ranges by `make lock`)."""
    def pins(path: Path, pattern: str) -> dict[str, str]:
        found = {}
        for line in path.read_text().splitlines():
            match = re.match(pattern, line)
            if match:
                found[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
        return found

    locked = pins(root / "requirements.lock", r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
    ranges = pins(root / "requirements.txt", r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*([=<>!~][^#;]*)?")
    rows = ["| package | locked (what CI executes the book with) | range requirements.txt allows |",
            "| --- | --- | --- |"]
    for name in SHOWN:
        allowed = (ranges.get(name) or "").strip()
        rows.append(f"| {name} | {locked[name]} | {f'`{allowed}`' if allowed else 'any'} |")
    return "\n".join(rows)


def _locked_versions(app, docname, source) -> None:
    # The reference page shows the lock's versions, read from requirements.lock at each build.
    if LOCKED_VERSIONS in source[0]:
        root = Path(app.srcdir)
        app.env.note_dependency(str(root / "requirements.lock"))
        source[0] = source[0].replace(LOCKED_VERSIONS, locked_versions_table(root))


def setup(app):
    app.connect("source-read", _locked_versions)
    app.connect("config-inited", _default_mode)
    app.connect("source-read", _vllm_version)
    app.connect("env-get-outdated", _reread_reckoning)
    app.connect("source-read", _name_the_chapter)
    app.connect("html-page-context", _one_of_each_script, priority=100)  # before any handler
    # that returns a template, which would stop the event (Sphinx emits it "first result")
    app.connect("build-finished", _copy_executed_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
