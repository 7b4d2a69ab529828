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
"""
import os
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
    elif item.test_outputs is not None:
        item.cell.outputs = item.test_outputs
        item.cell.execution_count = item.cell_num + 1


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
