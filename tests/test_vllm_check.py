"""tools/vllm_check.py: the maps' parser and checker on a small made-up release (``make
vllm-check`` runs the tool itself over every map of the book against the real one)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools import vllm_check

ROOT = Path(__file__).resolve().parent.parent

RELEASE = {
    "vllm/v1/core/block_pool.py": '''
class BlockPool:
    free_block_queue_class = None

    def __init__(self, num_blocks: int):
        self.blocks = []

    def get_new_blocks(self, num_blocks):
        return []
''',
    "vllm/v1/core/kv_cache_utils.py": '''
NONE_HASH: bytes

def init_none_hash(hash_fn):
    global NONE_HASH
''',
    "vllm/benchmarks/serve.py": '''
async def benchmark(backend, request_rate):
    pass

def main(args):
    pass
''',
}

PAGE = """# A chapter

::::{admonition} Where this lives in vLLM
:class: tip

| minipaged | vLLM v1 | difference |
| --- | --- | --- |
| `Pool` | `BlockPool.get_new_blocks`, `vllm/v1/core/block_pool.py` | same |
| `pool.blocks` | `BlockPool.blocks` and `free_block_queue_class`, `block_pool.py` | same |
| `NONE` | `vllm/v1/core/kv_cache_utils.py`: `NONE_HASH`, `init_none_hash` | same |
| `bench` | `benchmark` and `main` in `vllm/benchmarks/serve.py`; `torch.cuda.mem_get_info` | x |
| `fork` | v0's `vllm/core/block_manager.py`: `SelfAttnBlockSpaceManager.fork` | gone |
| `copy` | `copy_kernel` in `csrc/cache_kernels.cu` | C++ |
{stale}
::::
"""


@pytest.fixture
def release(tmp_path):
    for name, text in RELEASE.items():
        path = tmp_path / "release" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return vllm_check.Release(tmp_path / "release")


def write_page(tmp_path, stale=""):
    (tmp_path / "chapters").mkdir(exist_ok=True)
    page = tmp_path / "chapters" / "99_x.md"
    page.write_text(PAGE.replace("{stale}", stale))
    return page


def test_every_named_path_and_symbol_resolves(tmp_path, release):
    page = write_page(tmp_path)
    entries = vllm_check.entries(page, tmp_path)
    symbols = {e.name for e in entries if e.kind == "symbol" and e.checkable and not e.v0}
    assert symbols == {"BlockPool.get_new_blocks", "BlockPool.blocks", "free_block_queue_class",
                       "NONE_HASH", "init_none_hash", "benchmark", "main"}
    assert {e.name for e in entries if e.v0 and e.kind == "symbol"} == {
        "SelfAttnBlockSpaceManager.fork"}  # checked against the v0 release, when one is given
    unchecked = {e.name: e.why for e in entries if not e.checkable}
    assert unchecked["copy_kernel"] == "outside the wheel"
    assert vllm_check.check(release, tmp_path) == []  # without a v0 release: v0 rows unchecked


@pytest.mark.parametrize("stale, message", [
    ("| `gone` | `BlockPool.gone`, `vllm/v1/core/block_pool.py` | moved |",
     "BlockPool.gone is not defined in vllm/v1/core/block_pool.py"),
    ("| `moved` | `vllm/v1/core/moved.py`: `Moved` | moved |", "no file vllm/v1/core/moved.py"),
    ("| `short` | `nowhere.py` | x |", "no file ending in nowhere.py"),
    ("| `any` | `NotAnywhere` | x |", "NotAnywhere is not defined in the release"),
])
def test_a_stale_entry_is_named_at_its_chapter_line(tmp_path, release, stale, message):
    page = write_page(tmp_path, stale)
    line = page.read_text().splitlines().index(stale) + 1
    assert vllm_check.check(release, tmp_path) == [f"chapters/99_x.md:{line}: {message}"]


def test_defined_names_cover_methods_attributes_and_parameters():
    names = vllm_check.defined_names(RELEASE["vllm/v1/core/block_pool.py"])
    assert {"BlockPool", "BlockPool.get_new_blocks", "BlockPool.blocks",
            "BlockPool.free_block_queue_class", "BlockPool.get_new_blocks.num_blocks"} <= names


def test_the_release_is_written_once():
    version = vllm_check.configured_version()
    makefile = (ROOT / "Makefile").read_text()
    assert "VLLM_VERSION ?= $(shell sed" in makefile and "_config.yml" in makefile
    for path in [*ROOT.glob("chapters/*.md"), *ROOT.glob("book/*.md")]:
        assert version not in path.read_text(), (
            f"{path.name} writes the release; use {{{{ vllm_version }}}}")


def test_no_page_or_tool_mentions_an_index_of_copies():
    words = " ".join(["code", "index"])  # spelled apart: neither this file nor its .pyc matches
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():  # the repository's own files, not the virtualenvs' packages
        path = ROOT / name
        if path.is_file() and path.suffix in {".md", ".py", ".ipynb", ".yml", ".csv", ".txt"}:
            assert words not in path.read_text(errors="ignore").lower(), path


def test_v0_rows_are_checked_against_the_v0_release(tmp_path, release):
    """Given a v0 release, a v0 row's names are looked up there, and a missing one is stale."""
    write_page(tmp_path)
    stale = vllm_check.check(release, tmp_path, v0_release=release)  # a v1 release has no v0
    assert stale == ["chapters/99_x.md:12: no file vllm/core/block_manager.py (vLLM v0)"], stale


@pytest.mark.parametrize("difference, stale", [
    ("vLLM's `BlockPool.get_new_blocks` hands out `free_block_queue_class`", False),
    ("minipaged's `Pool.take`, attached to `Pool`, and `check_pool`", False),
    ("`Pool.taken`, set on self by the attached `take`", False),
    ("`num_blocks`, a parameter of the row's own file", False),
    ("`hash_fn`, a parameter of another file only", True),
    ("`pool`, a parameter of minipaged only", True),
    ('values are quoted, `"fp8_inc"`; other libraries prefixed, `torch.repeat_interleave`', False),
    ("vLLM's `BlockPool.vanished`", True),
    ("a bare value, `fp8_inc`", True),
])
def test_names_in_the_difference_column_are_vllms_or_minipageds(tmp_path, release, difference,
                                                                stale):
    """A name in the difference column must be defined in the release or in the package:
    ``Pool.take`` through ``@add_to_class(Pool)``, as the chapters attach methods."""
    (tmp_path / "minipaged").mkdir()
    (tmp_path / "minipaged" / "pool.py").write_text(
        "class Pool:\n    pass\n\n\n@add_to_class(Pool)\ndef take(self):\n    self.taken = 1\n\n\n"
        "def check_pool(pool):\n    pass\n")
    row = f"| `Pool` | `BlockPool`, `vllm/v1/core/block_pool.py` | {difference} |"
    page = write_page(tmp_path, row)
    line = page.read_text().splitlines().index(row) + 1
    found = vllm_check.check(release, tmp_path)
    assert bool(found) == stale, found
    assert all(f.startswith(f"chapters/99_x.md:{line}: ") and "difference column" in f
               for f in found)
