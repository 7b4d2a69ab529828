#!/usr/bin/env python3
"""Check the book's vLLM maps against one vLLM release, read from that release's own wheel.

Every chapter ends with a map, an admonition titled "Where this lives in vLLM" holding a table
whose vLLM column names files inside the release (``vllm/v1/core/block_pool.py``) and the
symbols they define (``BlockPool.get_new_blocks``). This tool

1. fetches the release's wheel once, with ``pip download --no-deps``, into a cache outside the
   repository (``$MINIPAGED_CACHE`` or ``~/.cache/minipaged``, then ``vllm-<version>/``), and
   unpacks only its ``vllm/**/*.py`` files there (``src/``); a wheel it downloaded is then
   deleted, while one placed in ``wheel/`` by hand is kept and used instead of a download;
2. parses every map of ``chapters/*.md`` and ``book/*.md`` (the maps themselves are the list)
   and checks that each path exists in the release and each symbol of the vLLM column is
   defined there: a class, a function, ``Class.method``, a module-level name, a class attribute
   or ``self.attribute``, an enum member, a parameter. A name in the difference column must be
   defined in the release or in minipaged itself (a value is quoted, ``"auto"``; another
   library's name carries its prefix, ``torch.``). A stale entry is printed as
   ``chapters/NN_slug.md:LINE: ...`` and the exit status is 1.

How a map cell is read. The vLLM column is split at semicolons into segments. A symbol is looked
up in the files its segment names; a segment that names none uses the files of its cell; a cell
that names none, the whole release. A segment that starts with ``v0`` (vLLM's first engine, not
in the v1 releases) is checked against the last release that has it, ``vllm_v0_version`` in
_config.yml (fetched the same way); one that names only files outside the wheel (``csrc/``,
``tests/``) is listed as not checkable, not failed. A backticked ``*.py`` that is not a
``vllm/`` path (``triton_attn.py``) must be the tail of a path of the release. Names of other
libraries (``torch.*``), Python's builtins, command-line flags and expressions are not symbols.

    python -m tools.vllm_check                    # the release _config.yml names
    python -m tools.vllm_check --version 0.34.0   # another one
    python -m tools.vllm_check --fetch-only       # print the unpacked release's root
"""
from __future__ import annotations

import argparse
import ast
import builtins
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "_config.yml"
MAP_TITLE = "Where this lives in vLLM"
FENCE = re.compile(r"^(?P<colons>:{3,})\{admonition\}\s*(?P<title>.*)$")
TICKED = re.compile(r"`([^`]+)`")
IDENT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
FOREIGN = ("torch.", "np.", "numpy.", "triton.", "tl.", "os.", "cuda")  # other libraries' names


def configured_version(config: Path = CONFIG, key: str = "vllm_version") -> str:
    """The release the book cites: ``vllm_version`` in _config.yml's substitutions (or
    ``vllm_v0_version``, the release whose v0 engine the v0 rows cite)."""
    match = re.search(rf'^\s*{key}:\s*"?([0-9][0-9A-Za-z.+-]*)"?\s*$', config.read_text(), re.M)
    if not match:
        raise SystemExit(f"{config}: no {key} substitution")
    return match.group(1)


def cache_dir(version: str) -> Path:
    base = Path(os.environ.get("MINIPAGED_CACHE", Path.home() / ".cache" / "minipaged"))
    return base / f"vllm-{version}"


def fetch(version: str, quiet: bool = False) -> Path:
    """The directory holding the release's ``vllm/`` package (Python files only), downloading
    and unpacking the wheel the first time."""
    home = cache_dir(version)
    src, done = home / "src", home / "src" / ".complete"
    if done.exists():
        return src
    wheels = home / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    downloaded = not found
    if not found:
        if not quiet:
            print(f"vllm-check: downloading the vllm {version} wheel into {wheels}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux1_x86_64",  # older releases' tag (0.10.2)
                        "--dest", str(wheels), f"vllm=={version}"], check=True)
        found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
        if not found:
            raise SystemExit(f"vllm-check: pip downloaded no vllm-{version} wheel")
    partial = home / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as wheel:
        for name in wheel.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                wheel.extract(name, partial)
    (partial / ".complete").write_text(found[0].name + "\n")
    shutil.rmtree(src, ignore_errors=True)
    partial.rename(src)
    if downloaded:  # the sources are the cache: drop the wheel pip fetched (about 250 MB)
        found[0].unlink()
    return src


# --- what a release defines ---------------------------------------------------------------

def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [name for element in node.elts for name in _targets(element)]
    return []


def defined_names(source: str, parameters: bool = True) -> set[str]:
    """Qualified names a module defines: ``f``, ``C``, ``C.m``, ``C.attr`` (class level or
    ``self.attr = ...`` in a method), ``NAME`` (module level), and ``f.param`` (with
    parameters)."""
    names, params = _definitions(source)
    return names | params if parameters else names


def _definitions(source: str) -> tuple[set[str], set[str]]:
    """defined_names' two parts, from one parse: the names, then the functions' parameters."""
    names: set[str] = set()
    params: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str, cls: str | None) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                names.add(prefix + node.name)
                visit(node.body, f"{prefix}{node.name}.", node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = prefix + node.name
                names.add(qual)
                every = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                params.update(f"{qual}.{arg.arg}" for arg in every)
                if cls is not None:
                    for inner in ast.walk(node):
                        targets = (inner.targets if isinstance(inner, ast.Assign) else
                                   [inner.target] if isinstance(inner, (ast.AnnAssign,
                                                                        ast.AugAssign)) else [])
                        for target in targets:
                            if (isinstance(target, ast.Attribute)
                                    and isinstance(target.value, ast.Name)
                                    and target.value.id == "self"):
                                names.add(prefix + target.attr)
                visit(node.body, f"{qual}.", None)
            elif isinstance(node, ast.Assign):
                names.update(prefix + name for t in node.targets for name in _targets(t))
            elif isinstance(node, ast.AnnAssign):
                names.update(prefix + name for name in _targets(node.target))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(node, part, []) or [], prefix, cls)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body, prefix, cls)

    visit(ast.parse(source).body, "", None)
    return names, params


def _attached_to(node: ast.stmt) -> str | None:
    """``C`` for a function decorated ``@add_to_class(C)`` (or ``(module.C)``), else None."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    for decorator in node.decorator_list:
        if (isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "add_to_class"
                and decorator.args):
            target = decorator.args[0]
            return target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
    return None


def package_names(root: Path = ROOT) -> set[str]:
    """The names minipaged defines, as defined_names reads them without parameters, plus
    ``C.f`` for every function a chapter attaches to a class with ``@add_to_class(C)``, and
    ``C.attr`` for each ``self.attr = ...`` in it."""
    names: set[str] = set()
    for module in sorted((root / "minipaged").rglob("*.py")):
        source = module.read_text()
        names |= defined_names(source, parameters=False)
        for node in ast.parse(source).body:
            owner = _attached_to(node)
            if owner is None:
                continue
            names.add(f"{owner}.{node.name}")
            names.update(f"{owner}.{target.attr}" for inner in ast.walk(node)
                         for target in getattr(inner, "targets", [getattr(inner, "target", None)])
                         if isinstance(target, ast.Attribute)
                         and isinstance(target.value, ast.Name) and target.value.id == "self")
    return names


class Release:
    """The Python files of one unpacked release and the names each defines (read lazily)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = sorted(p.relative_to(root).as_posix()
                            for p in (root / "vllm").rglob("*.py"))
        self._names: dict[str, tuple[set[str], set[str]]] = {}
        self._tails: set[str] | None = None  # declares' index of the whole release

    def has(self, path: str) -> bool:
        return (self.root / path).is_file()

    def tail(self, suffix: str) -> list[str]:
        return [p for p in self.paths if p == suffix or p.endswith("/" + suffix)]

    def _parts(self, path: str) -> tuple[set[str], set[str]]:
        if path not in self._names:
            try:
                self._names[path] = _definitions((self.root / path).read_text())
            except SyntaxError:
                self._names[path] = (set(), set())
        return self._names[path]

    def names(self, path: str) -> set[str]:
        members, params = self._parts(path)
        return members | params

    def members(self, path: str) -> set[str]:
        """The names of ``path`` without the functions' parameters."""
        return self._parts(path)[0]

    def declares(self, symbol: str, paths: list[str]) -> bool:
        """defines, without counting a function's parameter as a name it declares."""
        if not paths:  # the whole release: every dotted tail of every name, gathered once
            if self._tails is None:
                self._tails = {".".join(parts[i:]) for path in self.paths
                               for parts in map(lambda n: n.split("."), self.members(path))
                               for i in range(len(parts))}
            return symbol in self._tails
        return any(name == symbol or name.endswith("." + symbol)
                   for path in paths for name in self.members(path))

    def defines(self, symbol: str, paths: list[str]) -> bool:
        for path in paths or self.paths:
            for name in self.names(path):
                if name == symbol or name.endswith("." + symbol):
                    return True
        return False


# --- the maps ------------------------------------------------------------------------------

@dataclass
class Entry:
    file: str
    line: int
    kind: str  # "path", "symbol", or "mention" (a name in the difference column)
    name: str
    paths: list[str]  # where a symbol is looked up; [] for the whole release
    cell_paths: list[str] = field(default_factory=list)  # then the files of its whole cell
    checkable: bool = True
    why: str = ""
    v0: bool = False  # a row about vLLM's first engine: checked against the v0 release


def maps(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every map admonition in a page."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence and fence.group("title").strip().startswith(MAP_TITLE):
            close, j = fence.group("colons"), i + 1
            while j < len(lines) and lines[j].strip() != close:
                j += 1
            found.append((i + 1, lines[i:j]))
            i = j
        i += 1
    return found


def cells(row: str) -> list[str]:
    """A table row's cells, splitting at pipes outside backticks."""
    out, current, ticked = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            ticked = not ticked
        if char == "|" and not ticked:
            out.append(current.strip())
            current = ""
        else:
            current += char
    out.append(current.strip())
    return out


def is_symbol(token: str) -> bool:
    return (bool(IDENT.match(token)) and not token.startswith(FOREIGN)
            and not hasattr(builtins, token.split(".")[0]) and not token.endswith(".py"))


def entries(page: Path, root: Path = ROOT) -> list[Entry]:
    """Every path and symbol the maps of one page name, with the line each sits on."""
    rel = page.relative_to(root).as_posix() if page.is_relative_to(root) else str(page)
    found: list[Entry] = []
    for start, block in maps(page.read_text()):
        column = differ = None
        for offset, line in enumerate(block):
            lineno = start + offset
            is_row = line.lstrip().startswith("|")
            row = cells(line) if is_row else [line]
            if is_row and column is None:  # the header: find the vLLM column
                column = next((k for k, c in enumerate(row) if "vLLM" in c
                               and "minipaged" not in c), 1)
                differ = next((k for k, c in enumerate(row) if "difference" in c.lower()), None)
                continue
            if is_row and set("".join(row)) <= set("-: "):
                continue
            for k, cell in enumerate(row):
                ticks = TICKED.findall(cell)
                for token in ticks:  # paths anywhere in the map
                    if token.endswith(".py"):
                        found.append(Entry(rel, lineno, "path", token, []))
                if is_row and k == differ and column < len(row):  # vLLM's names or ours
                    v0_row = re.match(r"\s*v0\b", row[column]) is not None
                    row_paths = [t for t in TICKED.findall(row[column]) if t.endswith(".py")]
                    found += [Entry(rel, lineno, "mention", token, [], row_paths, v0=v0_row)
                              for token in ticks if is_symbol(token)]
                if not is_row or k != column:
                    continue
                cell_paths = [t for t in ticks if t.endswith(".py")]
                v0_cell = re.match(r"\s*v0\b", cell) is not None  # every segment is v0's
                for segment in cell.split(";"):
                    seg_ticks = TICKED.findall(segment)
                    seg_paths = [t for t in seg_ticks if t.endswith(".py")] or cell_paths
                    v0 = v0_cell or re.match(r"\s*v0\b", segment) is not None
                    outside = bool(seg_paths) and not any(
                        p.startswith("vllm/") or "/" not in p for p in seg_paths)
                    outside = outside or bool(re.search(r"`(csrc|tests)/", segment))
                    for token in seg_ticks:
                        if not is_symbol(token):
                            continue
                        entry = Entry(rel, lineno, "symbol", token, seg_paths, cell_paths)
                        entry.v0 = v0
                        if outside:  # csrc/ or tests/: in no wheel, v0's or v1's
                            entry.checkable, entry.why = False, "outside the wheel"
                        found.append(entry)
                if v0_cell:  # a v0 cell's paths name the removed engine
                    for entry in found:
                        if entry.line == lineno and entry.kind == "path":
                            entry.v0 = True
    for entry in found:  # files outside the wheel: the source tree's csrc/ and tests/
        if entry.kind == "path" and entry.name.startswith(("csrc/", "tests/")):
            entry.checkable, entry.why = False, "outside the wheel"
    return found


def pages(root: Path = ROOT) -> list[Path]:
    return sorted((root / "chapters").glob("*.md")) + sorted((root / "book").glob("*.md"))


def resolve(entry: Entry, release: Release) -> str | None:
    """None when the entry holds in the release, else why not."""
    if entry.kind == "path":
        if entry.name.startswith("vllm/"):
            return None if release.has(entry.name) else f"no file {entry.name}"
        return None if release.tail(entry.name) else f"no file ending in {entry.name}"
    paths: list[str] = []
    for path in entry.paths:
        paths += [path] if path.startswith("vllm/") else release.tail(path)
    paths = [p for p in paths if release.has(p)]
    if entry.paths and not paths:
        return None  # the stale path is reported on its own
    if release.defines(entry.name, paths):
        return None
    cell = [p for p in entry.cell_paths if p.startswith("vllm/") and release.has(p)]
    if cell and cell != paths and release.defines(entry.name, cell):
        return None  # named in another segment of the same cell
    where = ", ".join(paths) if paths else "the release"
    return f"{entry.name} is not defined in {where}"


def mentioned(entry: Entry, releases: list[Release], ours: set[str]) -> str | None:
    """None when a name of the difference column is defined in the files of its row's vLLM
    cell (a parameter counts), or declared anywhere in one of the releases or in minipaged (a
    parameter does not: too many names would pass), else why not."""
    for release in releases:
        cell = [p for p in entry.cell_paths if p.startswith("vllm/") and release.has(p)]
        if (cell and release.defines(entry.name, cell)) or release.declares(entry.name, []):
            return None
    if any(name == entry.name or name.endswith("." + entry.name) for name in ours):
        return None
    return (f"{entry.name}, in the difference column, is defined neither in the release nor "
            f"in minipaged (quote a value, `\"auto\"`; prefix another library's name, "
            f"`torch.`)")


def check(release: Release, root: Path = ROOT, verbose: bool = False,
          v0_release: Release | None = None) -> list[str]:
    """The stale entries of every map, as ``file:line: message`` lines; a v0 row's entries are
    looked up in v0_release (not checkable without one). A name in a difference column may be
    vLLM's (in a v0 row, of either release) or minipaged's."""
    stale, unchecked, seen = [], [], 0
    ours = package_names(root)
    for page in pages(root):
        for entry in entries(page, root):
            if entry.kind == "mention" and entry.v0 and v0_release is None:
                unchecked.append(f"{entry.file}:{entry.line}: {entry.name} (vLLM v0, not in a "
                                 f"v1 release)")
                continue
            if entry.kind == "mention":
                seen += 1
                why = mentioned(entry, [release] + ([v0_release] if entry.v0 and v0_release
                                                    else []), ours)
                if why:
                    stale.append(f"{entry.file}:{entry.line}: {why}")
                continue
            if entry.v0 and v0_release is None and entry.checkable:
                entry.checkable, entry.why = False, "vLLM v0, not in a v1 release"
            if not entry.checkable:
                unchecked.append(f"{entry.file}:{entry.line}: {entry.name} ({entry.why})")
                continue
            seen += 1
            why = resolve(entry, v0_release if entry.v0 else release)
            why = f"{why} (vLLM v0)" if why and entry.v0 else why
            if why:
                stale.append(f"{entry.file}:{entry.line}: {why}")
    if verbose:
        print(f"vllm-check: {seen} map entries checked; not checkable here:")
        print("\n".join("  " + line for line in unchecked))
    elif unchecked:
        print(f"vllm-check: {len(unchecked)} map entries cannot be checked here (files outside "
              f"the wheel, such as csrc/ C++ and CUDA sources: read them in the release's source "
              f"tree); -v lists them")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=None, help="vLLM release (default: _config.yml)")
    parser.add_argument("--v0-version", default=None,
                        help="the release the v0 rows cite (default: _config.yml)")
    parser.add_argument("--fetch-only", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    version = args.version or configured_version()
    root = fetch(version)
    if args.fetch_only:
        print(root)
        return 0
    v0_version = args.v0_version or configured_version(key="vllm_v0_version")
    v0_root = fetch(v0_version)
    stale = check(Release(root), verbose=args.verbose, v0_release=Release(v0_root))
    for line in stale:
        print(line)
    print(f"vllm-check: maps against vLLM {version} (v0 rows: {v0_version}): "
          f"{'all entries found' if not stale else f'{len(stale)} stale entries'}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
