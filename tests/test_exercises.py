"""Every chapter's exercises: 3 to 5 problems ending the chapter, at least one checking itself;
every checker accepts the repository's solution, rejects each wrong answer with a message that
names the case, and reads a stub (NotImplementedError) as not solved yet."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))
# A chapter may span pages (07_scheduler.md, 07_the_llm.md, 07_under_load.md): its last page
# ends with the exercises.
LAST_PAGES = list({chapter.name[:2]: chapter for chapter in CHAPTERS}.values())
# The checkers' modules, minipaged.exercises.chapter_NN; each chapter's solutions are in the
# repository's solutions/exercises_NN.py.
MODULES = sorted(f"chapter_{path.stem[-2:]}"
                 for path in (ROOT / "minipaged" / "exercises").glob("chapter_*.py"))


def solutions_of(module: str):
    return importlib.import_module(f"solutions.exercises_{module[-2:]}")


def checkers(module_name: str) -> dict:
    module = importlib.import_module(f"minipaged.exercises.{module_name}")
    return {name: function for name, function in vars(module).items()
            if name.startswith("check_") and inspect.isfunction(function)
            and function.__module__ == module.__name__}


# Checkers that run the engine on a model take seconds each: make check skips them, make test
# runs them.
ENGINE_CHECKERS = {"check_scheduler"}


def every_checker():
    return [pytest.param(module, name,
                         marks=[pytest.mark.heavy] if name in ENGINE_CHECKERS else [])
            for module in MODULES for name in checkers(module)]


def stub(*args, **kwargs):
    raise NotImplementedError


def test_every_chapter_has_an_exercise_module():
    numbers = sorted(chapter.name[:2] for chapter in CHAPTERS)
    assert MODULES == [f"chapter_{n}" for n in dict.fromkeys(numbers)]


@pytest.mark.parametrize("module", MODULES)
def test_every_checker_has_a_solution_and_wrong_answers(module):
    solutions = solutions_of(module).SOLUTIONS
    assert set(solutions) == set(checkers(module))
    for name, (solution, wrong) in solutions.items():
        assert callable(solution) and wrong, f"{module}.{name}: a solution and a wrong answer"


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize(("module", "name"), every_checker())
def test_checker_accepts_the_solution_and_rejects_wrong_answers(module, name):
    check = checkers(module)[name]
    solution, wrong = solutions_of(module).SOLUTIONS[name]
    verdict = check(solution)
    assert verdict.solved is True, verdict.message
    assert "solved" in repr(verdict)
    for answer in wrong:
        verdict = check(answer)
        assert verdict.solved is False, f"{answer.__name__} passed: {verdict.message}"
        assert re.search(r"case \d+", verdict.message), verdict.message  # names the case
    verdict = check(stub)
    assert verdict.solved is None and "not solved yet" in verdict.message


def exercise_section(chapter: Path) -> str:
    text = chapter.read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    titles = [section.split("\n", 1)[0] for section in sections[1:]]
    # The chapter ends with its exercises; appendices may not follow them.
    assert titles and titles[-1] == "Exercises", f"{chapter.name} ends with {titles[-1:]}"
    return sections[-1]


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("chapter", LAST_PAGES, ids=lambda path: path.name)
def test_chapter_ends_with_exercises_one_of_which_checks_itself(chapter):
    section = exercise_section(chapter)
    problems = re.findall(r"^\d+\. \*\*", section, flags=re.M)
    assert 3 <= len(problems) <= 5, f"{chapter.name}: {len(problems)} exercises"
    module = f"exercises.chapter_{chapter.name[:2]}"
    cells = [cell.source for cell in jupytext.reads("## " + section, fmt="md:myst").cells
             if cell.cell_type == "code"]
    assert any(f"from minipaged.{module} import check_" in source for source in cells), \
        f"{chapter.name}: no cell calls a checker of minipaged.{module}"
    assert any("raise NotImplementedError" in source for source in cells), \
        f"{chapter.name}: no stub for the reader to fill in"
