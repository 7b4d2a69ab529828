"""Small fixes to the built book that configuration alone cannot make (issue 12).

- Every script is included once: sphinx-thebe registers its configuration script on each
  read of the sources, and two copies on a page raise "THEBE_JS_URL has already been declared".
- The theme starts in a named colour mode, so a first visit logs no "invalid theme mode" error.
- Each chapter's executed notebook (with its outputs, as the build ran it) is copied next to the
  pages, under _executed/, for the download link that minipaged.js adds to each chapter.
- A chapter executed by the build runs with MINIPAGED_CHAPTER naming it, so that the values it
  glues are recorded under its name in _build/measured/ for chapter 12's reproduction table.
"""
from __future__ import annotations

import os
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


def _name_the_chapter(app, docname, source) -> None:
    # MyST-NB executes a notebook while parsing it, just after this event: its kernel inherits
    # the variable. Reading is serial here (jupyter-book does not read in parallel).
    if docname.startswith("chapters/"):
        os.environ["MINIPAGED_CHAPTER"] = docname.removeprefix("chapters/")
    else:
        os.environ.pop("MINIPAGED_CHAPTER", None)


def setup(app):
    app.connect("config-inited", _default_mode)
    app.connect("source-read", _name_the_chapter)
    app.connect("html-page-context", _one_of_each_script, priority=100)  # before any handler
    # that returns a template, which would stop the event (Sphinx emits it "first result")
    app.connect("build-finished", _copy_executed_notebooks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
