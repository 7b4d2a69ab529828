"""The introduction's first run: it runs (as the book build runs it), and the README shows it."""
import re
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
INTRO = ROOT / "book" / "intro.md"


def intro_code() -> list[str]:
    return [cell.source for cell in jupytext.read(INTRO).cells if cell.cell_type == "code"]


def test_the_intro_is_a_notebook_page_with_one_first_run():
    text = INTRO.read_text()
    assert text.startswith("---\njupytext:") and "kernelspec:" in text  # MyST-NB executes it
    assert len(intro_code()) == 1


def test_the_intro_first_run_runs(monkeypatch):
    monkeypatch.chdir(INTRO.parent)  # where the book build runs the page
    (code,) = intro_code()
    exec(compile(code, str(INTRO), "exec"), {})  # its own asserts check what comes back


def test_the_readme_shows_the_intro_first_run():
    (code,) = intro_code()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code.rstrip("\n") + "\n" in blocks
