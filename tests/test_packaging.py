"""The package's stated torch floor covers the torch APIs its code calls.

Each entry of NEEDS is an API the generated package uses and the first torch release that has
it; pyproject.toml's floor must be at least the latest of them, and the package must still use
every entry (so that the table cannot outlive the code)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

# API, the text in minipaged/*.py that uses it, the first torch with it, and where that is said.
NEEDS = [
    ("F.scaled_dot_product_attention(..., enable_gqa=...)", "enable_gqa=", (2, 5),
     "PyTorch 2.5 release notes: SDPA gains enable_gqa"),
    ("torch.OutOfMemoryError", "torch.OutOfMemoryError", (2, 5),
     "device-agnostic since pytorch#121702; 'from PyTorch 2.5.0' per huggingface/accelerate#3475"),
]


def torch_floor() -> tuple[int, ...]:
    dependencies = re.search(r"^dependencies = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(),
                             re.M).group(1)  # tomllib is 3.11's; the package supports 3.10
    spec = next(d.strip(' "') for d in dependencies.split(",") if d.strip(' "').startswith(
        "torch"))
    match = re.fullmatch(r"torch>=(\d+)\.(\d+)(?:\.\d+)?", spec.replace(" ", ""))
    assert match, f"pyproject.toml's torch requirement has no plain floor: {spec!r}"
    return int(match.group(1)), int(match.group(2))


def test_the_torch_floor_covers_every_api_the_package_calls():
    source = "".join(p.read_text() for p in (ROOT / "minipaged").glob("*.py"))
    for api, text, first, _ in NEEDS:
        assert text in source, f"the package no longer uses {api}: drop it from NEEDS"
        assert torch_floor() >= first, f"{api} needs torch>={first[0]}.{first[1]}"
    assert torch_floor() == max(first for *_, first, _ in NEEDS)  # the floor is this table's


def test_the_apis_exist_in_the_installed_torch():
    assert issubclass(torch.OutOfMemoryError, RuntimeError)
    query = torch.zeros(1, 4, 3, 8)
    key = value = torch.zeros(1, 2, 3, 8)  # two query heads share each KV head
    assert F.scaled_dot_product_attention(query, key, value, enable_gqa=True).shape == (1, 4, 3, 8)


def test_the_running_the_chapters_page_states_the_same_floor():
    floor = ".".join(map(str, torch_floor()))
    assert f"`torch>={floor}`" in (ROOT / "book" / "colab.md").read_text()
