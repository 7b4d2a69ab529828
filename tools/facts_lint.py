#!/usr/bin/env python3
"""One owner for each fact: flag a restated copy of a registry's names, an option's default, a
study figure or the kernels' largest block size, written outside the place that owns it.

The owners are read from the package itself, so the lint follows them when they change:

* engines: the names of ``minipaged.serving.SERVING_ENGINES`` (chapter 13);
* options: the fields of ``minipaged.llm.EngineArgs`` with a plain default, chapter 7's
  ``FrontEndArgs`` fields included (chapters 7 and 12);
* study figures: ``minipaged.reckoning.STUDY``, read from ``bench/results/study_figures.csv``
  (chapter 12);
* block sizes: ``minipaged.kernels.MAX_BLOCK_SIZE`` and the powers of two up to it (chapter 5).

A copy is only looked for where it reads as the fact, not as an unrelated number: a literal list
of two or more engine names, or three named in a sentence; a count of the engines in words ("four
engines", "four rows, one per engine"); an option's name with its default beside it on one line
(``gpu_memory_utilization=0.9`` in a string or the prose, "90% of the card",
``options.get("max_num_seqs", 256)``, ``x.max_num_seqs == 256``, a parameter or field defaulting
to it); a study figure's value given as its name's entry, compared with it, or in a sentence that
says "study"; the served block sizes as a literal run up to the largest, or the largest on a line
about block sizes. Prose includes captions and alt text in a cell's header. A value handed to a
call (``LLM(block_size=16)``) is input data, not a copy, and so is anything on a page before the
owner's chapter, which cannot import it. Each finding names the owner (module:symbol and its
chapter line). ALLOWED lists the few other exceptions, each with its reason.

    python tools/facts_lint.py            # the tree; exit status 1 when anything is found
    python tools/facts_lint.py --root DIR # another tree against this checkout's owners (the
                                          # planted-defect tests)
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ["chapters/*.md", "tests/**/*.py", "bench/**/*.py", "tools/*.py", "solutions/*.py",
           "README.md", "CONTRIBUTING.md", "book/*.md"]
# Pages tools/tangle.py writes from the owners themselves (the API page's option table reads
# EngineArgs' fields): a value there is the owner's, printed, not a copy.
GENERATED = {"book/api.md"}
MARKER = re.compile(r"^# (chapters/\S+\.md):(\d+)$")
FENCE = re.compile(r"^(```+|~~~+)")
COUNTS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
          "nine": 9, "ten": 10}
NUMBER = rf"\b({'|'.join(COUNTS)}|\d+)\b"
COUNTED = re.compile(rf"{NUMBER}\s+(?:\w+\s+)?(?:engines|baselines)\b", re.I)
PER_ENGINE = re.compile(rf"{NUMBER}[^.;]{{0,40}}?\bone (?:per|for each|an?) engine\b", re.I)
SKIPPED_OPTIONS = {"model", "seed"}  # a model name and a seed: input data wherever they appear
# Files another issue is rewriting: their findings are printed, marked, and fail nothing until it
# lands (then the entry goes). Chapter 13 was rewritten by issue 44 after the lint was written.
PENDING: dict[str, str] = {}
# (path, text the line contains, why it stays): the owner's own words, or input data that happens
# to equal a fact. Kept short; a new entry needs its reason.
ALLOWED = [
    ("bench/blocks.py", "kvcache_block_size", "nano-vllm's block size, an input of the bench"),
    ("bench/blocks.py", "minipaged's pools use 256 too", "the bench's input, set to nano-vllm's"),
    ("tests/test_swap.py", "swap_space=4 GiB asks for", "the test's own 4 GiB, echoed"),
    ("tests/test_t4_ledger.py", "gpu_memory_utilization=0.9)", "a chapter line the ledger reads"),
    ("tests/test_results_data.py", '"glued": {"kib_per_token": 12.0}}',
     "the record the test wrote at its top, read back"),
]


@dataclasses.dataclass(frozen=True)
class Owner:
    kind: str
    symbol: str  # module:symbol
    where: str  # the chapter line (or data file line) that writes it

    def __str__(self) -> str:
        return f"{self.symbol} ({self.where})"

    def chapter(self) -> tuple[str, int]:
        """The chapter and line that write the fact (the table of contents is in name order)."""
        found = re.search(r"(chapters/\S+\.md):(\d+)", self.where)
        return (found[1], int(found[2])) if found else ("", 0)


@dataclasses.dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    owner: Owner

    def __str__(self) -> str:
        return (f"{self.path}:{self.line}: FACT {self.what} restated; its owner is {self.owner}: "
                f"import or iterate it")


def chapter_line(root: Path, module: str, pattern: str) -> str:
    """The chapter line that writes the first line of minipaged/<module>.py matching pattern."""
    lines = (root / "minipaged" / f"{module}.py").read_text().splitlines()
    for index, text in enumerate(lines):
        if re.search(pattern, text):
            for back in range(index, -1, -1):
                if match := MARKER.match(lines[back]):
                    return f"{match[1]}:{int(match[2]) + index - back - 1}"
    return f"minipaged/{module}.py"


@dataclasses.dataclass
class Facts:
    """Every fact the lint guards, read from its owner."""

    engines: dict[str, Owner]
    counts: dict[int, Owner]  # how many engines, and how many reservation engines
    options: dict[str, tuple[object, Owner]]
    figures: dict[str, tuple[float, Owner]]
    block_sizes: tuple[int, ...]
    block_owner: Owner
    # the patterns the words of a line are searched with, made once from the facts above
    option_words: dict = dataclasses.field(init=False, repr=False)
    engine_word: re.Pattern = dataclasses.field(init=False, repr=False)
    figure_number: re.Pattern = dataclasses.field(init=False, repr=False)
    figure_values: dict = dataclasses.field(init=False, repr=False)
    largest_block: re.Pattern = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.option_words = {}
        for name, (default, _) in self.options.items():
            values = "|".join(re.escape(form) for form in number_text(default))
            if numeric(default):  # `name=0.9`, "name of 0.9", "`name` (0.9)"
                pattern = (rf"\b{name}\b[`\"']?[^.;!?\n]{{0,40}}?[=\s(`\"':](?:{values})"
                           rf"(?![\w]|[.,]\d)")
            else:  # a name or a flag is a choice unless the line calls it the default
                pattern = rf"\b{name}\b[^\n]{{0,60}}?\bdefaults?\b[^\n]{{0,30}}?\b(?:{values})\b"
            if numeric(default) and 0 < default < 1:  # a share of the card: "90% of the card"
                pattern += (rf"|(?<![\w.]){default * 100:g}\s?%\s+of\s+(?:the\s+)?(?:card|GPU|"
                            rf"device|memory)")
            self.option_words[name] = re.compile(pattern)
        names = "|".join(re.escape(name) for name in self.engines)
        self.engine_word = re.compile(rf"(?<![\w\"'])(?:{names})(?![\w\"'])")
        self.figure_values = {}
        for name, (value, _) in self.figures.items():
            for form in number_text(value):
                self.figure_values.setdefault(form.replace(",", "").replace("_", ""),
                                              []).append(name)
        forms = sorted({form for name, (value, _) in self.figures.items()
                        for form in number_text(value)}, key=len, reverse=True)
        self.figure_number = re.compile(
            rf"(?<![\w.,])(?:{'|'.join(re.escape(form) for form in forms)})(?![\w]|[.,]\d)")
        largest = self.block_sizes[-1]
        self.largest_block = re.compile(
            rf"(?<![\w.,]){largest}(?![\w]|[.,]\d)|\b2\s*\*\*\s*{largest.bit_length() - 1}\b")

    @classmethod
    def read(cls, root: Path) -> Facts:
        from minipaged import frontend, kernels, llm, reckoning, serving

        where = chapter_line(root, "serving", r"^SERVING_ENGINES\b")
        engine_owner = Owner("engines", "minipaged.serving:SERVING_ENGINES", where)
        reserving = [name for name, (manager, _) in serving.SERVING_ENGINES.items()
                     if issubclass(manager, serving.ReservationManager)]
        counts = {len(serving.SERVING_ENGINES): engine_owner,
                  len(reserving): Owner("engines", "minipaged.serving:SERVING_ENGINES "
                                        "(its ReservationManager entries)", where)}
        options = {}
        for field in dataclasses.fields(llm.EngineArgs):
            default = field.default
            if field.name in SKIPPED_OPTIONS or not isinstance(default, (bool, int, float, str)):
                continue
            chapter_7 = {f.name for f in dataclasses.fields(frontend.FrontEndArgs)}
            home = ("frontend", "FrontEndArgs") if field.name in chapter_7 else (
                "llm", "EngineArgs")
            place = chapter_line(root, home[0], rf"^    {field.name}: .* = ")
            options[field.name] = (default, Owner(
                "option", f"minipaged.{home[0]}:{home[1]}.{field.name}", place))
        csv = "bench/results/study_figures.csv"
        rows = (root / csv).read_text().splitlines()
        study = chapter_line(root, "reckoning", r"^STUDY = ")
        figures = {}
        for figure in reckoning.STUDY_FIGURES:
            row = next((n for n, text in enumerate(rows, 1) if text.startswith(figure.name + ",")),
                       0)
            figures[figure.name] = (figure.study, Owner(
                "figure", f"minipaged.reckoning:STUDY[{figure.name!r}]", f"{csv}:{row}, {study}"))
        largest = kernels.MAX_BLOCK_SIZE
        block_owner = Owner("block sizes", "minipaged.kernels:MAX_BLOCK_SIZE",
                            chapter_line(root, "kernels", r"^MAX_BLOCK_SIZE = "))
        return cls({name: engine_owner for name in serving.SERVING_ENGINES}, counts, options,
                   figures, tuple(2**i for i in range(largest.bit_length())), block_owner)


# ---- reading the tree: code (Python files, code cells) and prose ------------------------------

def pieces(path: Path, text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code blocks as (first line, source), prose lines as (line, text)) of one file."""
    lines = text.splitlines()
    if path.suffix == ".py":
        return [(1, text)], []
    code, prose, block, start, fence, header = [], [], [], 0, None, False
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, start, block, header = match[1], number + 1, [], False
        elif fence is not None and line.startswith(fence) and not line.strip(fence[0]).strip():
            code.append((start, "\n".join(block)))
            fence = None
        elif fence is not None:
            # a cell's options (`:tags:` or a `---` header) and magics are not Python: blank them,
            # keeping the line count
            if line == "---" and (not block or header):
                header = not header
                block.append("")
                continue
            words_only = header or line.startswith((":", "%", "!"))
            block.append("" if words_only else line)
            if words_only:  # a caption or alt text in the cell's header is read as prose
                prose.append((number, line))
        else:
            prose.append((number, line))
    return code, prose


def number_text(value) -> list[str]:
    """The ways a number is written: 2048, 2,048, 2_048; 0.9; a string's own text."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool):
        return [str(value)]
    if float(value) == int(value):
        whole = int(value)
        return sorted({str(whole), f"{whole:,}", f"{whole:_}", f"{float(whole)}"})
    return [repr(float(value))]


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same(literal, value) -> bool:
    if isinstance(value, bool) or isinstance(literal, bool):
        return literal is value
    if isinstance(value, str) or isinstance(literal, str):
        return literal == value
    return isinstance(literal, (int, float)) and literal == value


def constant(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(
            node.operand, ast.Constant) and isinstance(node.operand.value, (int, float)):
        return -node.operand.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        left, right = constant(node.left), constant(node.right)
        if isinstance(left, int) and isinstance(right, int) and 0 <= right < 64:
            return left**right
    return None


def name_of(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value if isinstance(node.slice.value, str) else None
    return None


class CodeCheck(ast.NodeVisitor):
    """The code forms of a restated fact in one block of Python."""

    def __init__(self, facts: Facts, report) -> None:
        self.facts, self.report = facts, report

    def option(self, node, name, literal, how: str, any_type: bool = True) -> None:
        if name in self.facts.options:
            default, owner = self.facts.options[name]
            if literal is not None and same(literal, default) and (any_type or numeric(default)):
                self.report(node.lineno, f"the default {name}={default!r} ({how})", owner)

    def visit_Call(self, node: ast.Call) -> None:
        callee = name_of(node.func)
        args = node.args
        if callee == "get" and len(args) == 2 and isinstance(args[0], ast.Constant):
            self.option(node, args[0].value, constant(args[1]), "a fallback")
        if callee == "getattr" and len(args) == 3 and isinstance(args[1], ast.Constant):
            self.option(node, args[1].value, constant(args[2]), "a fallback")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = [node.left, *node.comparators]
        for one, other in zip(sides, sides[1:]):
            for name_side, value_side in ((one, other), (other, one)):
                name = name_of(name_side)
                self.option(node, name, constant(value_side), "compared with", False)
                self.figure(node, name, constant(value_side))
        self.generic_visit(node)

    def visit_arguments(self, node: ast.arguments) -> None:
        positional = [*node.posonlyargs, *node.args]
        pairs = list(zip(positional[len(positional) - len(node.defaults):], node.defaults))
        pairs += [(arg, default) for arg, default in zip(node.kwonlyargs, node.kw_defaults)
                  if default is not None]
        for arg, default in pairs:
            self.option(default, arg.arg, constant(default), "a parameter's default")
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.option(node, name_of(node.target), constant(node.value), "a field's default")
        self.generic_visit(node)

    def figure(self, node, name, literal) -> None:
        if name in self.facts.figures and literal is not None:
            value, owner = self.facts.figures[name]
            if same(literal, value):
                self.report(node.lineno, f"the study figure {name}={value!r}", owner)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values):
            if isinstance(key, ast.Constant):
                self.option(value, key.value, constant(value), "a dict's entry", False)
                self.figure(value, key.value, constant(value))
        self.generic_visit(node)

    def visit_keyword(self, node: ast.keyword) -> None:
        literal = constant(node.value)  # num_layers=24 is a model's field before a figure
        if isinstance(literal, (int, float)) and distinctive(literal):
            self.figure(node.value, node.arg, literal)
        self.generic_visit(node)

    def sequence(self, node) -> None:
        items = [constant(item) for item in node.elts]
        names = [item for item in items if isinstance(item, str) and item in self.facts.engines]
        if len(set(names)) >= 2:
            self.report(node.lineno, f"a list of engine names {names}",
                        self.facts.engines[names[0]])
        sizes = self.facts.block_sizes
        if len(items) >= 4 and items == list(sizes[-len(items):]):  # a run up to the largest
            self.report(node.lineno, f"the block sizes the kernels serve {items}",
                        self.facts.block_owner)
        self.generic_visit(node)

    visit_List = visit_Tuple = visit_Set = sequence


def words(facts: Facts, text: str, report, prose: bool, options: bool = True,
          serving: bool = False) -> None:
    """The forms of a restated fact in one line of words (prose, or a string in code)."""
    for name, (default, owner) in facts.options.items() if options else ():
        if (name in text or "%" in text) and facts.option_words[name].search(text):
            report(f"the default {name}={default!r}", owner)
    named = facts.engine_word.findall(text) if prose else []
    if len(set(named)) >= 3:
        report(f"the engines' names {sorted(set(named), key=named.index)} listed",
               facts.engines[named[0]])
    if "engine" in text or "baselines" in text:
        # "the four engines' curves" (on a page about serving), "four rows, one per engine"
        for match in [*COUNTED.finditer(text), *PER_ENGINE.finditer(text)]:
            count = COUNTS.get(match[1].lower()) or (int(match[1]) if match[1].isdigit() else 0)
            if count in facts.counts and (serving or match.re is PER_ENGINE or re.search(
                    r"reserv|serving|SERVING", text)):
                report(f"the count of engines ({match[0]!r})", facts.counts[count])
    for match in facts.figure_number.finditer(text):
        for name in facts.figure_values[match[0].replace(",", "").replace("_", "")]:
            value, owner = facts.figures[name]
            if re.search(rf"\b{name}\b", text) or (prose and "study" in text
                                                    and distinctive(value)):
                report(f"the study figure {name}={value!r}", owner)
    if ("block_size" in text or "block size" in text) and facts.largest_block.search(text):
        report(f"the largest block size the kernels serve ({facts.block_sizes[-1]})",
               facts.block_owner)


def distinctive(value: float) -> bool:
    """A number unlikely to be anything else on a line that names the study: three digits or
    more, or a fraction."""
    digits = re.sub(r"\D", "", f"{value:g}").lstrip("0")
    return len(digits) >= 3 or (float(value) != int(value) and len(digits) >= 2)


def scan_file(facts: Facts, root: Path, path: Path) -> list[Finding]:
    relative = path.relative_to(root).as_posix()
    text = path.read_text()
    lines = text.splitlines()
    found: dict[tuple[int, str], Finding] = {}

    def add(line: int, what: str, owner: Owner) -> None:
        content = lines[line - 1] if 0 < line <= len(lines) else ""
        if any(relative == place and fragment in content for place, fragment, _ in ALLOWED):
            return
        if relative.startswith("chapters/") and (relative, line) <= owner.chapter():
            return  # the owner's own line, or a page before it, which cannot import it
        found.setdefault((line, what), Finding(relative, line, what, owner))

    code, prose = pieces(path, text)
    serving = "SERVING_ENGINES" in text or any(
        relative == owner.chapter()[0] for owner in facts.counts.values())
    for first, source in code:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            tree = None  # a shell or text block: its lines are read as words
        if tree is None:
            for offset, line in enumerate(source.splitlines()):
                words(facts, line, lambda what, owner, n=first + offset: add(n, what, owner),
                      prose=False, options=False)  # `x=16` in a shell line is its input
            continue
        CodeCheck(facts, lambda n, what, owner, f=first: add(f + n - 1, what, owner)).visit(tree)
        rows = [row.encode() for row in source.splitlines()]  # ast's columns count bytes
        for node in ast.walk(tree):  # a string, read as words, each of its lines where written
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for row in range(node.lineno, node.end_lineno + 1):
                    start = node.col_offset if row == node.lineno else 0
                    end = node.end_col_offset if row == node.end_lineno else None
                    piece = rows[row - 1][start:end].decode(errors="replace")
                    words(facts, piece, lambda what, owner, n=first + row - 1:
                          add(n, what, owner), prose=False)
    for number, line in prose:
        words(facts, line, lambda what, owner, n=number: add(n, what, owner), prose=True,
              serving=serving)
    return sorted(found.values(), key=lambda f: f.line)


def scan(root: Path, facts: Facts | None = None) -> list[Finding]:
    facts = facts or Facts.read(root)
    me = Path(__file__).resolve()
    paths = sorted({path for pattern in SCANNED for path in root.glob(pattern)
                    if path.is_file() and path.resolve() != me
                    and path.relative_to(root).as_posix() not in GENERATED})
    return [finding for path in paths for finding in scan_file(facts, root, path)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    sys.path.insert(0, str(ROOT))
    findings = scan(root, Facts.read(ROOT))  # the owners: the package this checkout imports
    failing = [finding for finding in findings if finding.path not in PENDING]
    for finding in findings:
        pending = PENDING.get(finding.path)
        print(f"{finding} (pending: {pending} rewrites this file)" if pending else finding)
    if findings:
        print(f"facts_lint: {len(failing)} restated facts"
              + (f", {len(findings) - len(failing)} more pending" if failing != findings else ""),
              file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
