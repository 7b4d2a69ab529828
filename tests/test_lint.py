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


# ---- tools/facts_lint.py: each fact written once, by its owner ---------------------------------

def facts_tool():
    from tools import facts_lint
    return facts_lint


@pytest.fixture(scope="module")
def facts_lint():
    return facts_tool()


@pytest.fixture(scope="module")
def facts(facts_lint):
    return facts_lint.Facts.read(ROOT)


def test_the_facts_are_read_from_their_owners(facts):
    from minipaged.kernels import MAX_BLOCK_SIZE
    from minipaged.llm import EngineArgs
    from minipaged.reckoning import STUDY
    from minipaged.serving import SERVING_ENGINES

    assert list(facts.engines) == list(SERVING_ENGINES)
    assert len(SERVING_ENGINES) in facts.counts
    for name, (default, owner) in facts.options.items():
        assert default == EngineArgs.__dataclass_fields__[name].default
        chapter, line = owner.chapter()
        assert name in (ROOT / chapter).read_text().splitlines()[line - 1], owner  # its line
    assert {"gpu_memory_utilization", "max_num_seqs", "block_size"} <= set(facts.options)
    assert set(facts.figures) == set(STUDY) and facts.block_sizes[-1] == MAX_BLOCK_SIZE
    chapter, line = facts.block_owner.chapter()
    assert "MAX_BLOCK_SIZE =" in (ROOT / chapter).read_text().splitlines()[line - 1]


def test_the_tree_restates_no_fact(facts_lint, facts):
    found = [str(f) for f in facts_lint.scan(ROOT, facts) if f.path not in facts_lint.PENDING]
    assert not found, "\n".join(found)


def planted(facts) -> dict[str, tuple[str, str, str]]:
    """One planted copy of each kind: file -> (its text, the line's start, the owner it names).
    Written from the facts, so that this file itself restates none."""
    names = list(facts.engines)
    gmu, seqs = facts.options["gpu_memory_utilization"][0], facts.options["max_num_seqs"][0]
    block = facts.options["block_size"][0]
    figure = next(f for f, (value, _) in facts.figures.items() if value >= 100)
    value = facts.figures[figure][0]
    count = {v: k for k, v in facts_tool().COUNTS.items()}[len(names)]
    sizes = list(facts.block_sizes)
    return {
        "tests/test_planted_list.py": (f"ENGINES = [{names[0]!r}, {names[-1]!r}]\n",
                                       "ENGINES", "SERVING_ENGINES"),
        "bench/planted_tuple.py": (f"for name in ({names[1]!r},\n             {names[2]!r}):\n"
                                   "    pass\n", "for name", "SERVING_ENGINES"),
        "book/planted_prose.md": (f"# Title\n\nWe compare {', '.join(names[:-1])} and "
                                  f"{names[-1]}.\n", "We compare", "SERVING_ENGINES"),
        "chapters/99_planted_count.md": (f"The {count} serving engines differ.\n", "The",
                                         "SERVING_ENGINES"),
        "chapters/99_planted_caption.md": ("```{code-cell} ipython3\n---\nmystnb:\n  figure:\n"
                                           f"    alt: {count.title()} rows, one per engine.\n"
                                           "---\nx = 1\n```\n", "    alt:", "SERVING_ENGINES"),
        "tools/planted_fallback.py": (f"def f(options):\n    return options.get("
                                      f"'gpu_memory_utilization', {gmu})\n", "    return",
                                      "FrontEndArgs.gpu_memory_utilization"),
        "tests/test_planted_string.py": (f'MESSAGE = "a batch of max_num_seqs={seqs} requests"\n',
                                         "MESSAGE", "FrontEndArgs.max_num_seqs"),
        "tests/test_planted_parameter.py": (f"def make(pool, block_size={block}):\n    pass\n",
                                            "def make", "FrontEndArgs.block_size"),
        "README.md": (f"Set `gpu_memory_utilization` (default {gmu}) to share the card.\n",
                      "Set", "FrontEndArgs.gpu_memory_utilization"),
        "chapters/99_planted_share.md": (f"A demo has no use for {gmu:.0%} of the card.\n",
                                         "A demo", "FrontEndArgs.gpu_memory_utilization"),
        "tests/test_planted_compare.py": (f"def test(args):\n    assert args.max_num_seqs == "
                                          f"{seqs}\n", "    assert", "FrontEndArgs.max_num_seqs"),
        "tests/test_planted_figure.py": (f'def test(STUDY):\n    assert STUDY["{figure}"] == '
                                         f"{value!r}\n", "    assert", f"STUDY[{figure!r}]"),
        "tests/test_planted_record.py": (f'record(path, {{"{figure}": {value!r}}})\n', "record",
                                         f"STUDY[{figure!r}]"),
        "chapters/99_planted_figure.md": (f"The study counted {value:,} of them.\n", "The study",
                                          f"STUDY[{figure!r}]"),
        "tests/test_planted_sizes.py": (f"SIZES = {sizes}\n", "SIZES", "MAX_BLOCK_SIZE"),
        "chapters/99_planted_block.md": (f"Any block size up to {sizes[-1]} is served.\n", "Any",
                                         "MAX_BLOCK_SIZE"),
    }


def test_each_planted_copy_is_found_at_its_line_naming_its_owner(facts_lint, facts, tmp_path):
    for path, (text, start, owner) in planted(facts).items():
        tree = tmp_path / path.replace("/", "_").replace(".", "_")
        (tree / path).parent.mkdir(parents=True)
        (tree / path).write_text(text)
        found = facts_lint.scan(tree, facts)
        line = next(n for n, row in enumerate(text.splitlines(), 1) if row.startswith(start))
        assert [(f.path, f.line) for f in found] == [(path, line)], (path, [str(f) for f in found])
        assert owner in str(found[0]) and "chapters/" in str(found[0]), str(found[0])


def test_input_data_equal_to_a_fact_is_not_a_copy(facts_lint, facts, tmp_path):
    gmu, block = facts.options["gpu_memory_utilization"][0], facts.options["block_size"][0]
    name = next(iter(facts.engines))
    quiet = {
        # a value chosen for a call, a single engine, an unrelated list, a later owner's fact on
        # an earlier page (which cannot import it)
        "tests/test_quiet.py": (f"llm = LLM(model, block_size={block}, gpu_memory_utilization="
                                f"{gmu})\nrun = SERVING_ENGINES[{name!r}]\nsizes = [1, 2, 3, 4]\n"),
        "chapters/01_quiet.md": f"With `gpu_memory_utilization={gmu}` the card fills.\n",
        "book/quiet.md": f"A pool of {facts.block_sizes[-1]} blocks holds a prompt.\n",
    }
    for path, text in quiet.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert not [str(f) for f in facts_lint.scan(tmp_path, facts)]


@pytest.mark.heavy  # a subprocess that imports the package: seconds
def test_facts_lint_exits_1_on_a_planted_copy_and_lint_runs_it(facts, tmp_path):
    path, (text, _, owner) = next(iter(planted(facts).items()))
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(text)
    result = subprocess.run([sys.executable, "-m", "tools.facts_lint", "--root", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1 and owner in result.stdout, result.stdout + result.stderr
    assert "tools.facts_lint" in (ROOT / "tools" / "lint.py").read_text().split("def main")[0]


def test_each_allowed_exception_still_names_a_line_of_the_tree(facts_lint):
    """An exception whose line is gone (the copy fixed, issue 45's ledger line replaced) must go
    too, so that the list stays the few places it claims to be."""
    for path, fragment, why in facts_lint.ALLOWED:
        assert why and fragment in (ROOT / path).read_text(), (path, fragment)
    assert len(facts_lint.ALLOWED) <= 8
