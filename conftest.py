"""Let one execution of each chapter serve both nbval and the book.

When MINIPAGED_SHARE_EXECUTION is set (``.ci/run`` sets it), every chapter that nbval runs
without a failure is stored, with the outputs nbval captured, in the book's jupyter-cache
(``_build/.jupyter_cache``). The book build that follows finds the chapter there by the hash
of its code and does not execute it a second time. A chapter with any failing cell is not
stored, so the book build executes it again and shows the failure.

Each chapter's kernel is started with MINIPAGED_CHAPTER naming the chapter, so that the values it
glues are recorded under its name in ``_build/measured/`` (chapter 1's runtime helper), where
chapter 12 reads them. A session that runs every chapter sets MINIPAGED_REQUIRE_MEASURED, and
chapter 12 then fails on any figure of the study that no chapter of this session measured.

A failing cell's report starts with the chapter line the cell starts on (and the line that
failed, when the traceback names it): nbval knows only the twin's cell number.
"""
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# No per-example deadline: on a shared 2-core machine a slow example is load, not a bug.
settings.register_profile("minipaged", deadline=None)
settings.load_profile("minipaged")

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / "_build" / ".jupyter_cache"


def pytest_collection_modifyitems(session, config, items):
    ran = {Path(str(item.parent.fspath)).stem for item in items
           if type(item).__name__ == "IPyNbCell"}
    every = {path.stem for path in (ROOT / "chapters").glob("[0-9][0-9]_*.md")}
    if every and every <= ran:
        os.environ["MINIPAGED_REQUIRE_MEASURED"] = "1"  # inherited by the kernels started next


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    if type(item).__name__ != "IPyNbCell":
        yield
        return
    before = os.environ.get("MINIPAGED_CHAPTER")
    # nbval starts a notebook's kernel while setting up its first cell: the kernel inherits this
    os.environ["MINIPAGED_CHAPTER"] = Path(str(item.parent.fspath)).stem
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MINIPAGED_CHAPTER", None)
        else:
            os.environ["MINIPAGED_CHAPTER"] = before


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if type(item).__name__ != "IPyNbCell" or call.when != "call":
        return
    report = outcome.get_result()
    notebook_file = item.parent
    if report.failed:
        notebook_file._minipaged_failed = True
        if place := chapter_place(item, call.excinfo.value if call.excinfo else None):
            report.longrepr = f"{place}\n\n{report.longrepr}"
    elif item.test_outputs is not None:
        item.cell.outputs = item.test_outputs
        item.cell.execution_count = item.cell_num + 1


def tangle_tool():
    """tools/tangle.py, imported (it finds where each code cell starts in a chapter)."""
    if "tangle" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tangle", ROOT / "tools" / "tangle.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tangle"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["tangle"]


ANSI = re.compile(r"\x1b\[[0-9;]*m")
CELL_FRAME = re.compile(r"Cell In\[\d+\], line (\d+)")  # IPython's name for the cell's frame


def chapter_place(item, error) -> str | None:
    """Where a twin's failing code cell sits in its chapter: "chapters/NN_slug.md:LINE", the line
    its code starts on, and the line that failed when the traceback names one. None for a
    notebook without a chapter beside it, or a twin out of step with its chapter."""
    chapter = Path(str(item.parent.fspath)).with_suffix(".md")
    if not chapter.exists():
        return None
    sources = [cell.source for cell in item.parent.nb.cells if cell.cell_type == "code"]
    try:
        start = tangle_tool().code_cell_lines(chapter, sources)[item.cell_num]
    except (SystemExit, IndexError):  # the fences and the twin's cells disagree: run tangle
        return None
    try:
        name = chapter.relative_to(item.config.rootpath).as_posix()
    except ValueError:
        name = str(chapter)
    place = f"{name}:{start}: Cell {item.cell_num} of the twin starts here"
    frame = CELL_FRAME.search(ANSI.sub("", getattr(error, "inner_traceback", None) or ""))
    if frame and int(frame.group(1)) > 1:
        place += f"; the line that failed is {name}:{start + int(frame.group(1)) - 1}"
    return place + " (edit the chapter, then run `make tangle`)"


def pytest_sessionfinish(session):
    if not os.environ.get("MINIPAGED_SHARE_EXECUTION"):
        return
    from jupyter_cache import get_cache
    from jupyter_cache.cache.main import CacheBundleIn

    files = {item.parent for item in session.items if type(item).__name__ == "IPyNbCell"}
    cache = get_cache(str(CACHE))
    for notebook_file in files:
        if getattr(notebook_file, "_minipaged_failed", False):
            continue
        source = Path(str(notebook_file.fspath)).with_suffix(".md")
        cache.cache_notebook_bundle(CacheBundleIn(notebook_file.nb, str(source)),
                                    check_validity=False, overwrite=True)
