"""book/_ext/minipaged_book.py: chapter 12's cached run is dropped when a chapter re-recorded."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest

# book/_ext, as Sphinx puts it on sys.path for _config.yml's local_extensions (last: it shadows
# nothing; tests/test_shadowing.py checks its names)
sys.path.append(str(Path(__file__).resolve().parents[1] / "book" / "_ext"))
import minipaged_book  # noqa: E402

jupyter_cache = pytest.importorskip("jupyter_cache")


def cached_chapter_12(root: Path):
    """A jupyter-cache under root holding one executed run of chapter 12; returns the cache."""
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    notebook.cells[0].outputs = []
    source = root / "chapters" / "12_what_it_bought.md"
    source.parent.mkdir(parents=True)
    source.write_text("# 12")
    cache = jupyter_cache.get_cache(str(root / "_build" / ".jupyter_cache"))
    from jupyter_cache.cache.main import CacheBundleIn
    cache.cache_notebook_bundle(CacheBundleIn(notebook, str(source)), check_validity=False)
    return cache


def record(root: Path, name: str, age_seconds: float) -> None:
    path = root / "_build" / "measured" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
def test_a_newer_record_of_another_chapter_drops_chapter_12s_cached_run(tmp_path):
    cache = cached_chapter_12(tmp_path)
    record(tmp_path, "12_what_it_bought", -3600)  # chapter 12's own record never counts
    assert minipaged_book.forget_stale_reckoning(tmp_path) == []
    record(tmp_path, "04_kv_cache", -3600)  # written an hour after the cached run
    assert len(minipaged_book.forget_stale_reckoning(tmp_path)) == 1
    assert cache.list_cache_records() == []


@pytest.mark.heavy  # a second: executes a notebook into a jupyter-cache
def test_records_older_than_the_cached_run_keep_it(tmp_path):
    cache = cached_chapter_12(tmp_path)
    record(tmp_path, "04_kv_cache", 3600)  # as after `make test`: chapters first, cache last
    assert minipaged_book.forget_stale_reckoning(tmp_path) == []
    assert len(cache.list_cache_records()) == 1


def test_an_incremental_build_rereads_chapter_12_with_any_other_chapter():
    class Env:
        found_docs = {"chapters/04_kv_cache", minipaged_book.READS_THE_RECORDS, "book/intro"}
    reread = minipaged_book._reread_reckoning
    assert reread(None, Env, set(), {"chapters/04_kv_cache"}, set()) == [
        minipaged_book.READS_THE_RECORDS]
    assert reread(None, Env, set(), {"book/intro"}, set()) == []


def test_the_book_skips_every_virtualenv_the_makefile_builds():
    # Sphinx reads every .md and .rst under the repository unless told not to; a virtualenv's
    # package READMEs then become "document isn't included in any toctree" warnings, errors here.
    import re

    import yaml

    root = Path(__file__).resolve().parent.parent
    makefile = (root / "Makefile").read_text()
    venvs = {re.search(r"^VENV := (\S+)", makefile, re.M).group(1),
             re.search(r"^MIN_VENV := (\S+)", makefile, re.M).group(1)}
    excluded = yaml.safe_load((root / "_config.yml").read_text())["exclude_patterns"]
    assert {f"{venv}/*" for venv in venvs} <= set(excluded), (venvs, excluded)


def test_the_vllm_release_is_written_into_code_blocks_too():
    # _config.yml's vllm_version is the release's one home: MyST substitutes it in prose, the
    # extension in the intro's download commands (code, which MyST leaves alone).
    class App:
        class config:
            myst_substitutions = {"vllm_version": "9.9.9"}

    source = ["pip download --no-deps vllm=={{ vllm_version }}\n`vllm-{{ vllm_version }}/`"]
    minipaged_book._vllm_version(App, "book/intro", source)
    assert source == ["pip download --no-deps vllm==9.9.9\n`vllm-9.9.9/`"]


def test_jupyter_book_hands_the_vllm_release_to_sphinx():
    import yaml
    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "_config.yml").read_text())
    assert config["parse"]["myst_substitutions"]["vllm_version"]
