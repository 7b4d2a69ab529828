"""No module of ours stands in front of an installed library (issue 43).

transformers 5.25 imports ``kernels``, a distribution of its own; a test that had put bench/ first
on sys.path made Python find bench/kernels.py instead. Every folder that can come first on
sys.path is listed here with why, and each top-level name found in one must be a name no
installed distribution provides (``importlib.metadata.packages_distributions()``).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (folder, why Python may search it first)
REACH = [
    (".", "`python -m` and pytest's rootdir put the repository root on sys.path"),
    ("tests", "pytest puts the folder of each test module (not a package) first"),
    ("chapters", "a chapter's notebook runs with its own folder as the kernel's working directory"),
    ("book/_ext", "Sphinx adds it for _config.yml's local_extensions"),
    ("bench", "a benchmark run by its path (python bench/x.py) puts its folder first"),
    ("bench/gpu_check", "python3 bench/gpu_check runs its __main__ with its folder first"),
    ("tools", "a tool run by its path (python tools/x.py) puts its folder first"),
    ("solutions", "a solutions module run by its path puts its folder first"),
]
OURS = {"minipaged"}  # the distribution this repository installs (pip install -e .)


def top_level_names(root: Path) -> dict[str, str]:
    """{module name: the file or package that provides it} over every folder in REACH."""
    names: dict[str, str] = {}
    for folder, _why in REACH:
        for path in sorted((root / folder).iterdir()) if (root / folder).is_dir() else []:
            if path.suffix == ".py" and path.stem not in ("__init__", "__main__"):
                names.setdefault(path.stem, str(path.relative_to(root)))
            elif path.is_dir() and (path / "__init__.py").is_file():
                names.setdefault(path.name, str(path.relative_to(root)) + "/")
    return names


def clashes(root: Path, provided: dict[str, list[str]]) -> list[str]:
    """One line per name of ours that an installed distribution (not ours) also provides."""
    lines = []
    for name, where in sorted(top_level_names(root).items()):
        others = sorted(set(provided.get(name, ())) - OURS)
        for dist in others:
            lines.append(f"{where} (module {name!r}) shadows the installed distribution "
                         f"{dist} {importlib.metadata.version(dist)}, which provides {name!r}: "
                         "rename ours")
    return lines


def test_no_module_of_ours_shadows_an_installed_distribution():
    found = clashes(ROOT, importlib.metadata.packages_distributions())
    assert not found, "\n".join(found)


def test_the_names_cover_every_folder_in_reach():
    names = top_level_names(ROOT)
    assert {"minipaged", "bench", "tools", "solutions", "conftest", "minipaged_book", "tangle",
            "kernel_speed", "stages", "exercises_01", "vllm_release"} <= set(names)
    assert names["bench"] == "bench/" and names["tangle"] == "tools/tangle.py"


def test_a_planted_module_named_after_a_library_is_caught(tmp_path):
    # planted defect: bench/numpy.py, beside a copy of the folders in reach
    for folder, _why in REACH:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "bench" / "engine.py").write_text("")
    (tmp_path / "bench" / "numpy.py").write_text("")
    provided = importlib.metadata.packages_distributions()
    assert "numpy" in provided
    found = clashes(tmp_path, provided)
    assert len(found) == 1 and found[0].startswith("bench/numpy.py (module 'numpy') shadows the "
                                                   "installed distribution numpy "), found
