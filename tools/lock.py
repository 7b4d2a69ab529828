"""requirements.lock: the exact versions `make venv` installs, made from requirements.txt's ranges.

    python -m tools.lock compile [--upgrade]  # pip-compile (make lock), keeping the lock's pins
    python -m tools.lock check                # the installed packages are the lock's (make venv)

``compile`` runs pip-tools' ``pip-compile`` (installed by ``make lock`` in .venv-lock, never in
.venv) with pip's own configuration, so it resolves against the indexes ``make venv`` installs
from. Without ``--upgrade`` it keeps each pin the ranges still allow and resolves only what
changed; with it, everything moves to the newest version the ranges allow. A pin is written
without its local label (torch ``2.13.0``, not ``2.13.0+cpu``): ``==2.13.0`` matches the CPU
build where a machine offers it (pip takes the highest match, and ``2.13.0+cpu`` sorts above
``2.13.0``) and PyPI's build elsewhere.

``check`` compares the distributions installed beside this interpreter with the lock, both ways:
a locked package missing or at another version, or an installed one the lock does not name, is
an error (the package itself, minipaged, and pip are left out). One exception: a package that an
installed locked package itself requires here (the nvidia-* wheels of PyPI's CUDA build of torch,
where a machine has no CPU build) is named but allowed; on the project's machines there is none.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"
RANGES = ROOT / "requirements.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")
NOT_LOCKED = {"minipaged", "pip"}  # the package itself (installed -e by make venv); the installer


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503): lower case, runs of -_. as -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of every pin in a lock file."""
    pins = {}
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            pins[canonical(match[1])] = match[2]
    return pins


def public(version: str) -> str:
    """A version without its local label: ``2.13.0+cpu`` -> ``2.13.0``."""
    return version.split("+", 1)[0]


def without_local_labels(text: str) -> str:
    """The lock's text with each pin's local label dropped (see the module's docstring)."""
    return "\n".join(PIN.sub(lambda m: f"{m[1]}=={public(m[2])}", line)
                     for line in text.splitlines()) + "\n"


def compile_lock(upgrade: bool) -> None:
    command = [sys.executable, "-m", "piptools", "compile", "--quiet", "--strip-extras",
               "--allow-unsafe", "--no-emit-index-url", "--no-emit-find-links",
               "--output-file", str(LOCK.name), str(RANGES.name)]
    if upgrade:
        command.append("--upgrade")
    # the header's "by the following command" line names make lock, not pip-compile's own
    subprocess.run(command, check=True, cwd=ROOT,
                   env={**os.environ, "CUSTOM_COMPILE_COMMAND": "make lock"})
    LOCK.write_text(without_local_labels(LOCK.read_text()))


def installed() -> dict[str, str]:
    """{canonical name: version} of the distributions this interpreter sees."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def required_here(names: set[str]) -> set[str]:
    """Every distribution that the installed distributions `names` require on this machine,
    directly or through another (their metadata's Requires-Dist, markers evaluated here)."""
    from packaging.requirements import Requirement  # pip-tools' and pytest's dependency

    seen, todo = set(), list(names)
    while todo:
        try:
            requires = importlib.metadata.distribution(todo.pop()).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                name = canonical(requirement.name)
                if name not in seen:
                    seen.add(name)
                    todo.append(name)
    return seen


def differences(locked: dict[str, str], have: dict[str, str],
                required: set[str] = frozenset()) -> list[str]:
    """What keeps `have` from being the lock: one line per package, empty when it is.

    A pin without a local label matches an installed version that has one (``==2.13.0`` is met by
    ``2.13.0+cpu``, as pip matches it); a pin with one must be met exactly."""
    lines = []
    for name, version in sorted(locked.items()):
        if name not in have:
            lines.append(f"{name}=={version} is locked but not installed")
        elif have[name] != version and ("+" in version or public(have[name]) != version):
            lines.append(f"{name} is {have[name]}, the lock says {version}")
    for name in sorted(set(have) - set(locked) - NOT_LOCKED - set(required)):
        lines.append(f"{name}=={have[name]} is installed but not in the lock")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.lock", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    compile_ = sub.add_parser("compile", help="write requirements.lock from requirements.txt")
    compile_.add_argument("--upgrade", action="store_true",
                          help="the newest versions the ranges allow, not the lock's pins")
    sub.add_parser("check", help="exit 1 unless this environment is the lock")
    args = parser.parse_args(argv)
    if args.command == "compile":
        compile_lock(args.upgrade)
        return 0
    locked, have = read_lock(), installed()
    required = required_here(set(locked) & set(have)) - set(locked) - NOT_LOCKED
    for name in sorted(required & set(have)):
        print(f"{LOCK.name}: {name}=={have[name]} is not in the lock, but a locked package "
              "requires it on this machine", file=sys.stderr)
    problems = differences(locked, have, required)
    for line in problems:
        print(f"{LOCK.name}: {line}", file=sys.stderr)
    if problems:
        print(f"{sys.prefix} is not {LOCK.name}: rebuild it (rm -rf .venv && make venv), or run "
              "`make lock` if requirements.txt changed", file=sys.stderr)
        return 1
    print(f"{sys.prefix}: {len(read_lock())} packages, as {LOCK.name} pins them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
