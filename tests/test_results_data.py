"""The committed results ship with the package: results_dir (chapter 1) finds the repository's
bench/results in a checkout and the package's copy in an install, pyproject.toml declares that
copy, and no chapter cell reads a repository file any other way."""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import jupytext
import pytest

from minipaged.runtime import gpu_results, results_dir

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def plant_gpu_run(results: Path, card: str = "Tesla T4") -> Path:
    """A GPU run's folder as bench/gpu_check leaves it: env.json, CSVs, and logs/."""
    folder = results / card.replace(" ", "_")
    (folder / "logs").mkdir(parents=True)
    (folder / "env.json").write_text(json.dumps({"device": "cuda", "gpu": card,
                                                 "started_at": "2026-12-01T10:00:00+00:00"}))
    (folder / "kernels.csv").write_text("kernel,gb_per_s\npaged per position,250\n")
    (folder / "chapter_01_glue.csv").write_text("chapter,cell,name,value\n"
                                                "01_kv_memory,3,kib_per_token,12.0\n")
    (folder / "stages.csv").write_text("stage,status\nkernels,ok\n")
    (folder / "logs" / "kernels.log").write_text("a console log, not a result\n")
    return folder


def shipped(results: Path) -> set[str]:
    """The files of results (relative) that pyproject.toml's package data selects."""
    with warnings.catch_warnings():  # setuptools calls its pyproject.toml support "beta"
        warnings.simplefilter("ignore")
        from setuptools.config.pyprojecttoml import read_configuration

        setuptools = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    assert "minipaged.results" in setuptools["packages"]
    assert setuptools["package-dir"]["minipaged.results"] == "bench/results"
    return {path.relative_to(results).as_posix()
            for pattern in setuptools["package-data"]["minipaged.results"]
            for path in results.glob(pattern) if path.is_file()}  # setuptools' own glob


# ---- where the results are found ----

def test_results_dir_is_the_repositorys_folder_in_a_checkout(tmp_path, monkeypatch):
    assert results_dir(root=tmp_path) == tmp_path / "bench" / "results"
    monkeypatch.chdir(ROOT / "chapters")  # a chapter runs in chapters/
    assert results_dir() == RESULTS
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "chapters").mkdir()
    monkeypatch.chdir(tmp_path / "chapters")  # the checkout a reader works in comes first
    assert results_dir() == tmp_path / "bench" / "results"


def test_results_dir_falls_back_on_the_copy_an_installed_package_carries(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    copy = site / "minipaged" / "results"
    plant_gpu_run(copy)
    (tmp_path / "content").mkdir()
    monkeypatch.chdir(tmp_path / "content")  # Colab's working directory: no repository above
    monkeypatch.setattr("importlib.resources.files", lambda package: site / package)
    assert results_dir() == copy
    assert gpu_results("kernels").path == copy / "Tesla_T4" / "kernels.csv"
    # the same package imported from a checkout reads the checkout's folder instead
    checkout = tmp_path / "checkout"
    (checkout / "bench" / "results").mkdir(parents=True)
    monkeypatch.setattr("importlib.resources.files", lambda package: checkout / package)
    assert results_dir() == checkout / "bench" / "results"
    assert gpu_results("kernels") is None


# ---- what the package carries ----

@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_the_package_data_selects_every_committed_result_and_a_gpu_runs_tables(tmp_path):
    committed = {path.relative_to(RESULTS).as_posix() for path in RESULTS.rglob("*")
                 if path.is_file() and path.suffix != ".tmp" and "logs" not in path.parts}
    assert {"blocks.csv", "engine.csv", "prefix_cache.csv", "compile_report.csv"} <= committed
    assert committed <= shipped(RESULTS)
    plant_gpu_run(tmp_path)
    assert shipped(tmp_path) == {"Tesla_T4/env.json", "Tesla_T4/kernels.csv",
                                 "Tesla_T4/chapter_01_glue.csv", "Tesla_T4/stages.csv"}


@pytest.mark.heavy
def test_an_installed_wheel_carries_the_results_and_reads_them_without_the_repository(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.tmp", "logs")
    shutil.copytree(ROOT / "minipaged", source / "minipaged", ignore=skip)
    shutil.copytree(RESULTS, source / "bench" / "results", ignore=skip)
    plant_gpu_run(source / "bench" / "results")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(source)],
                   check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("minipaged-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"minipaged/results/{name}" for name in shipped(source / "bench" / "results")} \
        <= names
    assert "minipaged/results/blocks.csv" in names
    assert not any("/logs/" in name for name in names)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")  # a pure-Python wheel, installed
    (tmp_path / "content").mkdir()
    probe = ("import json\nfrom minipaged.runtime import gpu_results, measured_dir, results_dir\n"
             "from minipaged.reckoning import gpu_records\n"
             "print(json.dumps({'dir': str(results_dir()), 'measured': measured_dir(),\n"
             "                  'kernels': gpu_results('kernels').gpu,\n"
             "                  'glued': gpu_records()[1]['values']}))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), MINIPAGED_DEVICE="cpu")
    env.pop("MINIPAGED_MEASURED_DIR", None)
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path / "content", env=env,
                           check=True, capture_output=True, text=True)
    seen = json.loads(found.stdout.strip().splitlines()[-1])
    assert seen == {"dir": str(tmp_path / "site" / "minipaged" / "results"), "measured": None,
                    "kernels": "Tesla T4", "glued": {"kib_per_token": 12.0}}


# ---- the chapters read repository files only through the package ----

REPOSITORY_PATH = re.compile(r"^(\.\./)?(bench|tools|tests|chapters|book|_build|minipaged)(/|$)")
READERS = {"Path", "open", "read_csv", "read_text", "loadtxt", "load", "glob"}
ALLOWED = {"results_dir", "measured_dir"}  # the helpers that know where the files are


def repository_reads(source: str) -> list[str]:
    """Where a cell's code names a repository file itself: a repository path given to Path, open
    or a reader, or joined with /, outside the ALLOWED helpers; or __file__ anywhere (a
    notebook's kernel has none, so even a helper's cell would fail in its chapter)."""
    lines = [re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in source.splitlines()]
    tree = ast.parse("\n".join(lines))
    skipped = {id(node) for function in ast.walk(tree)
               if isinstance(function, ast.FunctionDef) and function.name in ALLOWED
               for node in ast.walk(function)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "__file__" or \
                isinstance(node, ast.Attribute) and node.attr == "__file__":
            found.append(f"line {node.lineno}: __file__")
        if id(node) in skipped:
            continue
        arguments = []
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else \
                getattr(node.func, "id", "")
            arguments = node.args if called in READERS else []
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            arguments = [node.left, node.right]
        found += [f"line {node.lineno}: {argument.value!r}" for argument in arguments
                  if isinstance(argument, ast.Constant) and isinstance(argument.value, str)
                  and REPOSITORY_PATH.match(argument.value)]
    return found


def test_the_walker_catches_a_repository_read():
    assert repository_reads('p = Path(minipaged.__file__).parent.parent / "bench/results"')
    assert repository_reads('rows = open("bench/results/blocks.csv").read()')
    assert repository_reads('table = pd.read_csv("../bench/results/engine.csv")')
    assert not repository_reads('rows = (results_dir() / "blocks.csv").open()')
    assert not repository_reads('print("bench/results/blocks.csv is missing")')
    assert not repository_reads('def results_dir():\n    return Path.cwd() / "bench/results"')
    assert repository_reads('def gpu_results():\n    return Path.cwd() / "bench/results"')
    assert repository_reads('def results_dir():\n    return Path(__file__).parent')
    assert not repository_reads('meminfo = open("/proc/meminfo")')


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("chapter", sorted(p.name for p in (ROOT / "chapters").glob("[0-9]*.md")))
def test_no_chapter_cell_reads_a_file_that_a_pip_install_lacks(chapter):
    notebook = jupytext.read(ROOT / "chapters" / chapter)
    problems = [f"cell {index}, {problem}" for index, cell in enumerate(notebook.cells)
                if cell.cell_type == "code" for problem in repository_reads(cell.source)]
    assert not problems, (f"{chapter} reads repository files a pip install (Colab) does not "
                          f"carry; read them through minipaged.runtime.results_dir: {problems}")
