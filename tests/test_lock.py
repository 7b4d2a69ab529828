"""requirements.lock against the ranges it is made from, the package's own ranges, and the
reference page's table of versions (issue 43). `make venv` runs ``python -m tools.lock check``,
which holds the installed environment to the lock."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

from tools.lock import LOCK, RANGES, canonical, differences, read_lock, without_local_labels

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "book" / "_ext"))  # as Sphinx adds it (tests/test_shadowing.py)
import minipaged_book  # noqa: E402


def requirements(lines: list[str]) -> list[Requirement]:
    return [Requirement(line.split("#")[0].strip()) for line in lines
            if line.split("#")[0].strip() and not line.startswith("-")]


def test_every_range_is_pinned_in_the_lock_and_the_pin_is_in_range():
    locked = read_lock()
    for requirement in requirements(RANGES.read_text().splitlines()):
        name = canonical(requirement.name)
        assert name in locked, f"{name} is in requirements.txt but not in the lock: run make lock"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"the lock's {name}=={locked[name]} is outside requirements.txt's "
            f"{requirement.specifier}: run make lock")


def test_the_lock_meets_the_packages_own_ranges():
    # pip install minipaged[hf] claims these ranges; the lock CI executes must lie inside them
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    claimed = project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                         for r in extra]
    locked = read_lock()
    for requirement in requirements(claimed):
        version = locked[canonical(requirement.name)]
        assert requirement.specifier.contains(version), (requirement, version)


def test_the_lock_carries_no_local_labels_and_no_machine_paths():
    text = LOCK.read_text()
    assert "+" not in "".join(read_lock().values())
    assert not re.search(r"^\s*(--index-url|--extra-index-url|--find-links|-f )", text, re.M)
    assert "make lock" in text  # pip-compile's header names the command that rewrites it


def test_the_reference_page_shows_the_locks_versions():
    table = minipaged_book.locked_versions_table(ROOT)
    locked = read_lock()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1]
            for line in table.splitlines()[2:]}
    assert list(rows) == ["torch", "triton", "transformers", "jupyter-book", "numpy"]
    assert rows == {name: locked[name] for name in rows}
    assert minipaged_book.LOCKED_VERSIONS in (ROOT / "book" / "colab.md").read_text()


def test_the_environment_check_finds_each_kind_of_difference():
    locked = {"torch": "2.13.0", "numpy": "2.4.6", "triton": "3.9.0"}
    assert differences(locked, {"torch": "2.13.0+cpu", "numpy": "2.4.6", "triton": "3.9.0",
                                "minipaged": "0.1.0", "pip": "23.2.1"}) == []
    found = differences(locked, {"torch": "2.13.1", "numpy": "2.4.6", "kernels": "0.19.1"})
    assert found == [
        "torch is 2.13.1, the lock says 2.13.0", "triton==3.9.0 is locked but not installed",
        "kernels==0.19.1 is installed but not in the lock"]
    # what a locked package's own build requires here is allowed (PyPI's CUDA torch: nvidia-*)
    assert differences({"torch": "2.13.0"}, {"torch": "2.13.0", "nvidia-nccl-cu12": "2.27.3"},
                       {"nvidia-nccl-cu12"}) == []
    # a pin with a local label is met by that build only
    assert differences({"torch": "2.13.0+cpu"}, {"torch": "2.13.0"}) == [
        "torch is 2.13.0, the lock says 2.13.0+cpu"]


def test_pins_lose_their_local_label_only():
    text = "torch==2.13.0+cpu\n    # via -r requirements.txt\nnumpy==2.4.6\n"
    assert without_local_labels(text) == text.replace("+cpu", "")
