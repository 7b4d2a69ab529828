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


def test_the_book_pages_install_from_the_configured_repository():
    """The pages that show an install or a clone name _config.yml's repository.url, its one
    owner (tools/tangle.py writes it into the chapters' first cells)."""
    from tools.tangle import repository_url

    url = repository_url()
    for page in ("intro.md", "colab.md"):
        text = (ROOT / "book" / page).read_text()
        named = re.findall(r"git\+([^\s\"'`@]+)", text) + re.findall(r"git clone (\S+)", text)
        assert named and set(named) == {url}, (page, named)
        assert "pip install minipaged" not in text  # no PyPI release: always from the repository
