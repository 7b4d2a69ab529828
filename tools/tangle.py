#!/usr/bin/env python3
"""Tangle the chapters into the package, and check that the two agree.

The chapters (``chapters/NN_slug.md``, Jupytext MyST notebooks) are the only source of
``minipaged``'s code, in the manner of nbdev:

* a cell whose first lines hold ``#| default_exp memory`` names the chapter's default module;
* a cell whose first lines hold ``#| export`` goes into that module;
* ``#| export kv_cache`` sends one cell to another module instead;
* ``#| export exercises.chapter_07`` sends a cell to chapter 7's module of exercise checkers,
  ``minipaged/exercises/chapter_07.py`` (the subpackage ``minipaged.exercises`` holds only the
  checkers, so that the package's top level is the engine a reader imports).

Every module is owned by exactly one chapter. Each generated file starts with a header that
names it and records a hash of the body, and each exported block in it is preceded by a marker
comment giving the chapter line it came from (``# chapters/01_kv_memory.md:60``). Next to every
chapter sits an ``.ipynb`` twin without outputs (for Colab, which opens it on a T4, and nbval).

The repository's address is written once, in ``_config.yml`` (``repository.url``). Every chapter's
first code cell installs the package from it: tangle rewrites each address that cell names (the
install line and its error message) to that one, so a fork sets its address there and tangles.

    python -m tools.tangle          # write minipaged/*.py, the .ipynb twins and book/api.md,
                                    # and each chapter's install address from _config.yml;
                                    # refuses to overwrite a module edited by hand
    python -m tools.tangle --check  # exit 1 when a file differs from a fresh tangle; prints the
                                    # diff and the chapter line of each differing block
    python -m tools.tangle --changed-since main  # the twins of the chapters to run under nbval
"""
from __future__ import annotations

import argparse
import ast
import difflib
import hashlib
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^#\|\s*(default_exp|export)\b\s*(\S*)\s*$")
MODULE_NAME = re.compile(r"^(exercises\.chapter_\d\d|[a-z_][a-z0-9_]*)$")
# The one subpackage: the exercises' checkers, a module per chapter (exercises.chapter_NN).
EXERCISES = "exercises"
FENCE = re.compile(r"^(`{3,}|~{3,})\{code-cell\}")
MARKER = re.compile(r"^# (chapters/\S+\.md):(\d+)$")
BODY_HASH = re.compile(r"^# body sha256: ([0-9a-f]{16})\b")
INSTALL_URL = re.compile(r"git\+([^\s\"'@]+)")  # the address a chapter's pip line installs from

# The package's public surface: names re-exported by minipaged/__init__.py, module by module.
# module -> the names `from minipaged import ...` gives, each "Name" or "Name as Alias". The
# package's LLM is the last chapter's front end: chapter 14's, which adds kv_cache_dtype to
# chapter 12's options (a tree without chapter 14 exports chapter 12's).
PUBLIC = {"quantized": ["QuantizedLLM as LLM"], "sampling": ["SamplingParams"]}
FALLBACK = {"quantized": ("llm", ["LLM"])}


@dataclass
class Block:
    """One exported cell's code, and the chapter line its first line of code sits on."""

    code: str
    line: int


@dataclass
class Module:
    name: str
    chapter: str
    cells: list[Block] = field(default_factory=list)


def split_directives(source: str) -> tuple[list[tuple[str, str]], str]:
    """Return the leading ``#|`` directives of a cell and the code that follows them."""
    lines = source.splitlines()
    directives = []
    while lines and DIRECTIVE.match(lines[0]):
        kind, arg = DIRECTIVE.match(lines[0]).groups()
        directives.append((kind, arg))
        lines.pop(0)
    return directives, "\n".join(lines).strip("\n")


def code_cell_lines(chapter: Path, sources: list[str]) -> list[int]:
    """The 1-based line of the chapter on which each code cell's source begins."""
    lines = chapter.read_text().splitlines()
    fences = [n for n, line in enumerate(lines) if FENCE.match(line)]
    if len(fences) != len(sources):
        sys.exit(f"{chapter.name}: found {len(fences)} code-cell fences for "
                 f"{len(sources)} code cells")
    starts = []
    for fence, source in zip(fences, sources):
        first = source.splitlines()[0] if source.strip() else None
        start = fence + 1  # past the fence, then past any :option: lines or --- block
        while first is not None and start < len(lines) and lines[start] != first:
            start += 1
        starts.append((start if start < len(lines) else fence + 1) + 1)
    return starts


def collect(chapters: list[Path]) -> dict[str, Module]:
    """Read every chapter and gather its exported cells into modules, in chapter order."""
    modules: dict[str, Module] = {}
    for chapter in chapters:
        notebook = jupytext.read(chapter)
        source = chapter.relative_to(ROOT).as_posix()
        code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        starts = code_cell_lines(chapter, [cell.source for cell in code_cells])
        default = None
        for cell, start in zip(code_cells, starts):
            directives, code = split_directives(cell.source)
            # The first line of code that reaches the module: past the directives and past
            # the blank lines that split_directives strips.
            rest = cell.source.splitlines()[len(directives):]
            skipped = next((n for n, line in enumerate(rest) if line), 0)
            line = start + len(directives) + skipped
            for kind, arg in directives:
                if kind == "default_exp":
                    default = arg
                    continue
                target = arg or default
                if not target:
                    sys.exit(f"{source}:{start}: '#| export' before any '#| default_exp'")
                if not MODULE_NAME.match(target):
                    sys.exit(f"{source}:{start}: '{target}' is not a module name")
                module = modules.setdefault(target, Module(target, source))
                if module.chapter != source:
                    sys.exit(f"{source}:{start}: module '{target}' is already written by "
                             f"{module.chapter}")
                module.cells.append(Block(code, line))
    return modules


def body_hash(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def with_header(first: str, body: str) -> str:
    """A generated Python file: its header, the hash of its body, then the body."""
    return (f"{first}\n# body sha256: {body_hash(body)} (`make tangle` refuses to overwrite "
            f"this file once edited)\n{body}")


def render_module(module: Module) -> str:
    blocks = [f"# {module.chapter}:{block.line}\n{block.code}" for block in module.cells]
    body = "\n" + "\n\n\n".join(blocks) + "\n"
    first = (f"# AUTOGENERATED from {module.chapter} by tools/tangle.py. Do not edit this file:\n"
             f"# edit the chapter at the line each block's marker names, then run `make tangle`.")
    return with_header(first, body)


def module_path(name: str) -> Path:
    """The file of a module of the package: minipaged/memory.py, or for a dotted name
    minipaged/exercises/chapter_01.py."""
    return ROOT / "minipaged" / (name.replace(".", "/") + ".py")


def render_exercises_init() -> str:
    return with_header("# AUTOGENERATED by tools/tangle.py. Do not edit.",
                       '"""The exercises\' checkers, a module per chapter, written by its '
                       'chapter\'s\n``#| export exercises.chapter_NN`` cells: '
                       '``from minipaged.exercises.chapter_01\nimport check_kv_bytes_per_token``.'
                       '"""\n')


def render_init(modules: dict[str, Module]) -> str:
    lines = [
        '"""minipaged: paged KV-cache memory, built one chapter at a time."""',
        "",
        "from . import runtime  # noqa: F401  (first: it sets up Triton's interpreter on CPU)",
    ]
    exported = []
    for name, public in PUBLIC.items():
        if name not in modules and name in FALLBACK:
            name, public = FALLBACK[name]
        if name in modules:
            lines.append(f"from .{name} import {', '.join(public)}")
            exported += [item.split(" as ")[-1] for item in public]
    lines += ["", '__version__ = "0.1.0"', f"__all__ = {exported!r}", ""]
    return with_header("# AUTOGENERATED by tools/tangle.py from the chapters' public names. "
                       "Do not edit.", "\n".join(lines))


def _page_link(chapter: str) -> str:
    """The API page's relative link to a chapter's page (book/api.md -> chapters/NN_slug.md)."""
    return "../" + chapter


def _page_title(chapter: str) -> str:
    """A chapter's title, its first top-level heading, as the sidebar shows it (the file's name
    when it has none)."""
    path = ROOT / chapter
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return next((line[2:].strip() for line in lines if line.startswith("# ")), chapter)


OPTION_CHAPTER = re.compile(r"#\s*chapter\s+(\d+(?:\.\d+)?):?\s*(.*)$")


def _chapter_by_number(number: str) -> str | None:
    """The chapter file whose title starts with this number ("7.2", or "8" for "# 8. ...")."""
    for chapter in chapter_files():
        title = _page_title(chapter.relative_to(ROOT).as_posix())
        if title.split(" ", 1)[0].rstrip(".") == number:
            return chapter.relative_to(ROOT).as_posix()
    return None


def dataclass_options(module: Module, class_name: str) -> list[tuple[str, str, str, str]]:
    """A dataclass's fields in a module's cells, as (name, default, chapter, what): the default's
    source, and the chapter and words of the field's trailing comment ``# chapter N: what``."""
    for block in module.cells:
        tree = ast.parse(block.code)
        lines = block.code.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                rows = []
                for field_node in node.body:
                    if not (isinstance(field_node, ast.AnnAssign)
                            and isinstance(field_node.target, ast.Name)):
                        continue
                    default = (ast.get_source_segment(block.code, field_node.value)
                               if field_node.value is not None else "")
                    line = lines[field_node.lineno - 1]
                    comment = OPTION_CHAPTER.search(line[line.find("#"):] if "#" in line else "")
                    if not comment:
                        sys.exit(f"{module.chapter}:{block.line + field_node.lineno - 1}: option "
                                 f"{field_node.target.id} needs a '# chapter N: what' comment")
                    rows.append((field_node.target.id, default, comment.group(1),
                                 comment.group(2)))
                return rows
    return []


def render_options(modules: dict[str, Module]) -> list[str]:
    """The table of LLM's options: chapter 7's FrontEndArgs and chapter 12's EngineArgs fields,
    read from their code, so that the page cannot drift from the defaults."""
    if "frontend" not in modules or "llm" not in modules:
        return []
    rows = dataclass_options(modules["frontend"], "FrontEndArgs")
    rows += dataclass_options(modules["llm"], "EngineArgs")
    if "quantized" in modules:
        rows += dataclass_options(modules["quantized"], "QuantizedEngineArgs")
    table = ["## The options of `LLM`", "",
             "`LLM(model, **options)` takes these keyword options (`EngineArgs`, read from its "
             "code when this page is generated). The three marked *LLMFrontEnd only* are the "
             "classes chapter 7's `LLMFrontEnd` takes by hand; `LLM` chooses them itself from "
             "the options of chapters 8 to 11.", "",
             "| option | default | what it sets | explained in |", "| --- | --- | --- | --- |"]
    for name, default, number, what in rows:
        chapter = _chapter_by_number(number)
        where = (f"[chapter {number}](<{_page_link(chapter)}>)" if chapter else
                 f"chapter {number}")
        what = what.replace("|", "\\|")
        table.append(f"| `{name}` | `{default}` | {what} | {where} |")
    return table + [""]


def render_api_page(modules: dict[str, Module]) -> str:
    """The book's API reference: one autodoc section per module, in chapter order."""
    lines = [
        "% AUTOGENERATED by tools/tangle.py. Do not edit.",
        "# API reference",
        "",
        "The package's public surface is small: `from minipaged import LLM, SamplingParams`. "
        "`LLM` and its options, `EngineArgs`, keep vLLM's names (chapter 12, `minipaged.llm`; "
        "the package exports chapter 14's `QuantizedLLM` as `LLM`, chapter 12's with one more "
        "option, `kv_cache_dtype`); they subclass chapter 7's front end, `LLMFrontEnd`, and its "
        "`FrontEndArgs` "
        "(`minipaged.frontend`), which take the engine's parts as classes. "
        "The building blocks are importable from their modules, listed here in the order the "
        "chapters write them; each module's source names the chapter to edit.",
        "",
    ] + render_options(modules)
    ordered = sorted(modules.values(), key=lambda m: (m.chapter, m.name != "runtime"))
    checkers = [m for m in ordered if m.name.startswith(EXERCISES + ".")]
    for module in [m for m in ordered if m not in checkers]:
        lines += api_section("##", module)
    if checkers:
        lines += [f"## The exercises' checkers: `minipaged.{EXERCISES}`", "",
                  "Each chapter's exercises that check themselves call a checker from the "
                  "chapter's module of this subpackage, which prints its verdict and returns it "
                  "(chapter 1 explains the grading they share, `minipaged.grading`).", ""]
        for module in checkers:
            lines += api_section("###", module)
    return "\n".join(lines)


def api_section(level: str, module: Module) -> list[str]:
    """One module's section of the API page: its heading, its chapter, its autodoc."""
    return [
        f"{level} `minipaged.{module.name}`",
        "",
        f"Written by [{_page_title(module.chapter)}](<{_page_link(module.chapter)}>).",
        "",
        "```{eval-rst}",
        f".. automodule:: minipaged.{module.name}",
        "   :members:",
        "```",
        "",
    ]


# Colab reads these and opens the notebook on a T4 GPU runtime instead of a CPU one.
COLAB_METADATA = {"accelerator": "GPU", "colab": {"gpuType": "T4", "provenance": []}}


def repository_url() -> str | None:
    """_config.yml's repository.url: the address every chapter installs from (None: no config)."""
    import yaml  # a dependency of jupytext

    config = ROOT / "_config.yml"
    if not config.exists():
        return None
    return yaml.safe_load(config.read_text()).get("repository", {}).get("url")


def with_install_url(text: str, url: str | None) -> str:
    """A chapter's text whose first code cell installs from url: the address its pip line names
    (``git+ADDRESS``) is replaced by url wherever that cell writes it."""
    lines = text.split("\n")
    fences = [n for n, line in enumerate(lines) if FENCE.match(line)]
    if url is None or not fences:
        return text
    start = fences[0]
    fence = FENCE.match(lines[start]).group(1)
    end = next((n for n in range(start + 1, len(lines)) if lines[n].strip() == fence), len(lines))
    cell = "\n".join(lines[start:end])
    match = INSTALL_URL.search(cell)
    if match is None or match.group(1) == url:
        return text
    lines[start:end] = cell.replace(match.group(1), url).split("\n")
    return "\n".join(lines)


def render_twin(chapter: Path, text: str) -> str:
    """The chapter (text, its Markdown) as an .ipynb without outputs, minus jupytext's own
    bookkeeping."""
    notebook = jupytext.reads(text, fmt="md:myst")
    notebook.metadata.pop("jupytext", None)
    notebook.metadata.update(COLAB_METADATA)
    for number, cell in enumerate(notebook.cells):
        cell["id"] = f"cell-{number:03d}"  # fixed ids, so the twin is the same on every run
    return jupytext.writes(notebook, fmt="ipynb")


def chapter_files() -> list[Path]:
    return sorted((ROOT / "chapters").glob("[0-9][0-9]_*.md"))


def expected_files() -> dict[Path, str]:
    chapters = chapter_files()
    modules = collect(chapters)
    files = {module_path(m.name): render_module(m) for m in modules.values()}
    files[ROOT / "minipaged" / "__init__.py"] = render_init(modules)
    if any(name.startswith(EXERCISES + ".") for name in modules):
        files[ROOT / "minipaged" / EXERCISES / "__init__.py"] = render_exercises_init()
    files[ROOT / "book" / "api.md"] = render_api_page(modules)
    url = repository_url()
    for chapter in chapters:
        text = with_install_url(chapter.read_text(), url)
        files[chapter] = text  # itself, unless its install cell names another address
        files[chapter.with_suffix(".ipynb")] = render_twin(chapter, text)
    return files


def generated_paths() -> list[Path]:
    return (sorted((ROOT / "minipaged").glob("*.py"))
            + sorted((ROOT / "minipaged" / EXERCISES).glob("*.py"))
            + sorted((ROOT / "chapters").glob("*.ipynb")))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def hand_edited(path: Path) -> bool | None:
    """Whether a generated .py file's body no longer matches the hash in its header.

    None when the file is not a generated module at all (no AUTOGENERATED header). False for
    a file written before headers carried a hash, and for one holding git's conflict markers.
    """
    if path.suffix != ".py" or not path.exists():
        return False
    text = path.read_text()
    lines = text.split("\n")
    if any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in lines):
        return False  # a merge conflict in generated code: a fresh tangle is the resolution
    if not lines[0].startswith("# AUTOGENERATED"):
        return None
    for number, line in enumerate(lines[:4]):
        if match := BODY_HASH.match(line):
            return body_hash("\n".join(lines[number + 1:])) != match.group(1)
    return False  # an older tangle's file: no hash to compare with


def location(expected: list[str], index: int) -> str | None:
    """The chapter line that line `index` of a freshly tangled module comes from."""
    for back in range(min(index, len(expected) - 1), -1, -1):
        if match := MARKER.match(expected[back]):
            return f"{match.group(1)}:{int(match.group(2)) + max(index - back - 1, 0)}"
    return None


def located_diff(path: Path, text: str, edit_first: bool = False) -> list[str]:
    """A unified diff between the file as it is and a fresh tangle, each hunk naming the chapter
    line to edit. By default it shows what tangle would change; with edit_first, the hand edit
    (the file as it is) is the `+` side."""
    ours = path.read_text().splitlines() if path.exists() else []
    fresh = text.splitlines()
    name = rel(path)
    labels = [f"{name} (as it is)", f"{name} (as the chapters write it)"]
    old, new = (fresh, ours) if edit_first else (ours, fresh)
    if edit_first:
        labels.reverse()
    out = [f"--- {labels[0]}", f"+++ {labels[1]}"]
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for group in matcher.get_grouped_opcodes(3):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        changed = next(op for op in group if op[0] != "equal")
        at = changed[1] if edit_first else changed[3]  # the index on the fresh side
        where = location(fresh, min(at, len(fresh) - 1)) if fresh else None
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@"
                   + (f" edit {where}" if where else ""))
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in old[a1:a2]]
                continue
            out += ["-" + line for line in old[a1:a2]]
            out += ["+" + line for line in new[b1:b2]]
    return out


def chapter_locations(path: Path, text: str) -> list[str]:
    """The chapter lines of the blocks in which the file differs from a fresh tangle."""
    fresh = text.splitlines()
    matcher = difflib.SequenceMatcher(None, path.read_text().splitlines(), fresh, autojunk=False)
    places = []
    for tag, _, _, j1, _ in matcher.get_opcodes():
        if tag != "equal" and fresh and (where := location(fresh, min(j1, len(fresh) - 1))):
            places.append(where)
    return list(dict.fromkeys(places))


def stale_files(expected: dict[Path, str]) -> list[str]:
    """Generated files that differ from a fresh tangle, or that no chapter writes any more."""
    problems = []
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            problems.append(f"{rel(path)} differs from a fresh tangle")
    for path in generated_paths():
        if path not in expected:
            problems.append(f"{rel(path)} is written by no chapter")
    return problems


def report_differences(expected: dict[Path, str]) -> int:
    """--check: name every file out of sync, with a located diff for the Python modules."""
    problems = stale_files(expected)
    for problem in problems:
        print(f"out of sync: {problem}", file=sys.stderr)
    for path, text in expected.items():
        if path.suffix == ".ipynb" or (path.exists() and path.read_text() == text):
            continue
        edited = bool(hand_edited(path))
        if edited:
            print(f"{rel(path)} was edited by hand; move the edit to "
                  f"{', '.join(chapter_locations(path, text)) or 'its chapter'}", file=sys.stderr)
        print("\n".join(located_diff(path, text, edit_first=edited)), file=sys.stderr)
    if problems:
        print("Edit the chapters, not the package; then run `make tangle`.", file=sys.stderr)
    return 1 if problems else 0


def code_only(text: str) -> list[str]:
    """A generated file's lines without its bookkeeping (header, hash, block markers): a file
    that differs from a fresh tangle only there (a git merge of two tangles) lost no edit."""
    return [line for line in text.splitlines()
            if not (MARKER.match(line) or BODY_HASH.match(line) or line.startswith(
                ("# AUTOGENERATED", "# edit the chapter")))]


def refusals(expected: dict[Path, str]) -> list[str]:
    """Generated files that tangle would overwrite or delete, losing an edit made by hand."""
    refused = []
    for path in generated_paths():
        edited = hand_edited(path)
        if path in expected and edited and code_only(path.read_text()) != code_only(expected[path]):
            places = ", ".join(chapter_locations(path, expected[path])) or "its chapter"
            refused.append(f"{rel(path)} was edited by hand (its body no longer matches the hash "
                           f"in its header). Move the edit into {places}, then run "
                           f"`make tangle` again; `tools/tangle.py --force` discards it (as it "
                           f"should after a merge that combined two tangles of one chapter).\n"
                           + "\n".join(located_diff(path, expected[path], edit_first=True)))
        elif path not in expected and path.suffix == ".py" and edited is not False:
            why = "was edited by hand" if edited else "was not written by tangle"
            refused.append(f"{rel(path)} is written by no chapter and {why}: move its code into "
                           f"a chapter's '#| export' cell, or delete the file.")
    return refused


def imported_modules(source: str) -> set[str]:
    """The names under ``minipaged`` that a piece of Python imports or reads, at any depth
    (function-level imports too): ``memory`` for ``from minipaged.memory import x``,
    ``import minipaged.memory``, ``from minipaged import memory``, ``from .memory import x``,
    ``from . import memory`` or ``minipaged.memory.x``; ``LLM`` for ``from minipaged import LLM``
    (a name the package's ``__init__`` re-exports). A bare ``import minipaged`` names nothing."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .memory import x, or from . import memory
                names = [f"minipaged.{node.module}"] if node.module else [
                    f"minipaged.{alias.name}" for alias in node.names]
            elif node.module in ("minipaged", f"minipaged.{EXERCISES}"):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                names = [node.module or ""]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "minipaged"):
            names = [f"minipaged.{node.attr}"]  # import minipaged.kernels; minipaged.kernels.f
        else:
            continue
        found |= {module_of(name) for name in names if name.startswith("minipaged.")}
    return found


def module_of(name: str) -> str:
    """The package's module a dotted name under ``minipaged`` reaches: ``memory`` for
    ``minipaged.memory.x``; ``exercises.chapter_07`` for a name in that checkers' module."""
    parts = name.split(".")
    if parts[1] == EXERCISES and len(parts) > 2:
        return f"{EXERCISES}.{parts[2]}"
    return parts[1]


def package_files(package: Path) -> dict[str, Path]:
    """Every module file of the package by its dotted name under it (``__init__`` for the
    package's own, ``exercises`` for the subpackage's)."""
    files = {path.stem: path for path in sorted(package.glob("*.py"))}
    for path in sorted((package / EXERCISES).glob("*.py")):
        files[EXERCISES if path.stem == "__init__" else f"{EXERCISES}.{path.stem}"] = path
    return files


def cell_code(source: str) -> str:
    """A code cell's Python: IPython's magics and shell lines (%pip, !ls) dropped."""
    return "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))


def package_module(name: str, modules: set[str]) -> str:
    """The package's module a name under ``minipaged`` comes from: itself when it is a module,
    else ``__init__`` (``LLM`` is one of the names the package's __init__ makes)."""
    return name if name in modules else "__init__"


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of the package, ``__init__`` included, mapped to the package's modules it
    imports. Every import statement counts, at any depth, and so do imports made only for their
    side effects (``from . import prefix_cache  # noqa: F401`` in __init__)."""
    files = package_files(package)
    graph = {}
    for name, path in files.items():
        imported = imported_modules(path.read_text())
        graph[name] = {package_module(target, set(files)) for target in imported} - {name}
    return graph


def dependents(graph: dict[str, set[str]], changed: set[str]) -> set[str]:
    """The changed modules, and every module that imports one of them, directly or through
    other modules (a subclass's module, then the modules that import that one, ...)."""
    affected = set(changed)
    while more := {module for module, targets in graph.items() if targets & affected} - affected:
        affected |= more
    return affected


def chapter_imports(chapter: Path, modules: set[str]) -> set[str]:
    """The package's modules a chapter's own code cells import (``__init__`` for
    ``from minipaged import LLM``). The setup cell's bare ``import minipaged`` counts for nothing:
    every chapter has it, and it uses no name of the package."""
    found = set()
    for cell in jupytext.read(chapter).cells:
        if cell.cell_type != "code":
            continue
        try:
            names = imported_modules(cell_code(cell.source))
        except SyntaxError:
            continue  # a cell that is not Python fails in its own chapter's run, if anywhere
        found |= {package_module(name, modules) for name in names}
    return found


def changed_since(base: str) -> list[Path]:
    """The .ipynb twins of the chapters to run: those whose source changed since `base` (the
    merge base of HEAD and `base`, plus uncommitted and untracked changes), those whose
    generated modules changed, and those whose cells import a module whose code changed or a
    module that depends on one, through the package's import graph (a chapter that imports only
    a subclass's module runs when the base class's module changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout

    try:
        merge_base = git("merge-base", "HEAD", base).strip()
        changed = set(git("diff", "--name-only", merge_base).split())
    except (subprocess.CalledProcessError, FileNotFoundError):
        print(f"tangle: no merge base with {base!r}; selecting every chapter", file=sys.stderr)
        return [chapter.with_suffix(".ipynb") for chapter in chapter_files()]
    changed |= set(git("ls-files", "--others", "--exclude-standard").split())
    chapters = chapter_files()
    modules = collect(chapters)
    owner = {rel(module_path(m.name)): m.chapter for m in modules.values()}
    touched = {rel(c) for c in chapters if rel(c) in changed}
    touched |= {owner[path] for path in changed if path in owner}
    # A module whose code changed also sends every chapter that imports it, or imports a module
    # that depends on it; markers that moved because prose was added above a cell are not a
    # change of code.
    def code_changed(path: str) -> bool:
        before = subprocess.run(["git", "-C", str(ROOT), "show", f"{merge_base}:{path}"],
                                capture_output=True, text=True).stdout
        return code_only(before) != code_only((ROOT / path).read_text())

    generated = set(owner) | {"minipaged/__init__.py"}
    changed_modules = {path[len("minipaged/"):-3].replace("/", ".") for path in changed
                       if path in generated
                       and (not (ROOT / path).exists() or code_changed(path))}  # or deleted
    package = ROOT / "minipaged"
    affected = dependents(import_graph(package), changed_modules) if changed_modules else set()
    names = set(package_files(package))
    selected = [c for c in chapters
                if rel(c) in touched or (affected and chapter_imports(c, names) & affected)]
    return [chapter.with_suffix(".ipynb") for chapter in selected]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    parser.add_argument("--force", action="store_true",
                        help="overwrite generated files even when they were edited by hand")
    parser.add_argument("--changed-since", metavar="BRANCH",
                        help="print the twins of the chapters changed since BRANCH, and exit")
    args = parser.parse_args(argv)
    if args.changed_since:
        print(" ".join(rel(path) for path in changed_since(args.changed_since)))
        return 0
    expected = expected_files()
    if args.check:
        return report_differences(expected)
    if not args.force and (refused := refusals(expected)):
        for message in refused:
            print(message, file=sys.stderr)
        print("tangle wrote nothing.", file=sys.stderr)
        return 1
    for stale in generated_paths():
        if stale not in expected:
            stale.unlink()
            print(f"removed {rel(stale)}")
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)  # minipaged/exercises/ the first time
            path.write_text(text)
            print(f"wrote {rel(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
