"""tools/lint.py: ruff's findings in generated modules point at the chapter line to edit."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_tool():
    spec = importlib.util.spec_from_file_location("lint", ROOT / "tools" / "lint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy  # seconds: make check leaves it to make test
def test_every_line_of_a_generated_block_maps_to_the_same_text_in_its_chapter():
    lint = lint_tool()
    mapped = 0
    for module in sorted((ROOT / "minipaged").glob("*.py")):
        for row, text in enumerate(module.read_text().splitlines(), start=1):
            if not text or (found := lint.chapter_line(module, row)) is None:
                continue  # blank lines: tangle's between blocks, or a cell's own
            chapter, line = found
            assert chapter.read_text().splitlines()[line - 1] == text, (module.name, row)
            mapped += 1
    assert mapped > 1000  # every module's code, not only its first lines
    init = ROOT / "minipaged" / "__init__.py"
    assert lint.chapter_line(init, 3) is None  # written from tangle's own table, no chapter
    assert lint.chapter_line(ROOT / "tools" / "tangle.py", 1) is None  # not generated


@pytest.mark.heavy  # a subprocess or a scratch repository: seconds
def test_lint_names_the_chapter_line_of_a_finding_in_a_generated_module(tmp_path):
    for folder in ("minipaged", "chapters"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.ipynb"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("import sys\n")  # hand-written: left as is
    blocks = tmp_path / "minipaged" / "blocks.py"
    target = "        self.block_size = pool.block_size"
    blocks.write_text(blocks.read_text().replace(target, target + "  ", 1))  # W291
    row = blocks.read_text().splitlines().index(target + "  ") + 1
    chapter = tmp_path / "chapters" / "03_block_pool.md"
    line = chapter.read_text().splitlines().index(target) + 1

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # the tools package

    result = run(sys.executable, "-m", "tools.lint", "minipaged", "tests")
    ruff = run(sys.executable, "-m", "ruff", "check", "--output-format", "concise",
               "minipaged", "tests")
    assert result.returncode == ruff.returncode == 1
    out = result.stdout.splitlines()
    col = len(target) + 1
    assert (f"chapters/03_block_pool.md:{line}:{col}: W291 [*] Trailing whitespace "
            f"(minipaged/blocks.py:{row}:{col})") in out
    hand_written = [text for text in ruff.stdout.splitlines() if text.startswith("tests/")]
    assert hand_written and set(hand_written) <= set(out)  # as ruff prints it
    assert not any(text.startswith("minipaged/") for text in out)


def test_make_lint_and_make_check_lint_through_the_wrapper():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("lint", "check"):
        recipe = makefile.split(f"\n{target}:")[1].split("\n\n")[0]
        assert "-m tools.lint" in recipe and "ruff check" not in recipe, target
