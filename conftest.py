"""Let one execution of each chapter serve both nbval and the book.

When MINIPAGED_SHARE_EXECUTION is set (``.ci/run`` sets it), every chapter that nbval runs
without a failure is stored, with the outputs nbval captured, in the book's jupyter-cache
(``_build/.jupyter_cache``). The book build that follows finds the chapter there by the hash
of its code and does not execute it a second time. A chapter with any failing cell is not
stored, so the book build executes it again and shows the failure.
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
