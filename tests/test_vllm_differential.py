"""vLLM's own FreeKVCacheBlockQueue, BlockPool and KVCacheManager beside minipaged's.

Runs under ``make vllm-check``, which fetches the release named by VLLM_VERSION (see
tools/vllm_check.py) and sets the variable; without it the tests that need vLLM are skipped. The
harness is tests/vllm_differential.py, the loader and its stubs tests/vllm_release.py, and the
differences allowed are the rows of book/vllm_differences.csv, which the book shows.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import vllm_differential as diff  # noqa: E402

from minipaged.prefix_cache import PrefixCacheStats, PrefixCachingBlockPool  # noqa: E402
from minipaged.scheduler import NoNewBlocks  # noqa: E402

VERSION = os.environ.get("VLLM_VERSION")
needs_vllm = pytest.mark.skipif(not VERSION, reason="needs a vLLM release: make vllm-check")
SEEDS = range(int(os.environ.get("VLLM_DIFF_SEEDS", "400")))
NUM_OPS = 200


@pytest.fixture(scope="module")
def vllm():
    import vllm_check
    import vllm_release
    return vllm_release.load(vllm_check.fetch(VERSION))


def pool_size(seed: int) -> int:
    return 6 + seed % 20  # from a pool that runs dry at once to one that rarely does


def test_the_table_names_only_allowances_the_test_applies():
    table = diff.read_table()
    assert set(table) == set(diff.ALLOWANCES), "a row the test does not apply, or the reverse"
    assert all(row["why"].strip() and row["difference"].strip() for row in table.values())


def sweep(vllm, caching: bool, allowed: set[str]) -> tuple[int, dict[str, int]]:
    """Every seed's run; fails with the shortest sequence at the first divergence. Returns the
    number of operations compared and how many runs each listed difference stopped early."""
    compared, stopped = 0, {}
    for seed in SEEDS:
        ops = diff.random_ops(seed, NUM_OPS)
        outcome = diff.run(vllm, ops, caching, pool_size(seed), allowed)
        if outcome.failure is not None:
            pytest.fail(f"seed {seed}: " + diff.report(vllm, ops, caching, pool_size(seed),
                                                        allowed), pytrace=False)
        compared += outcome.at
        if outcome.listed:
            stopped[outcome.listed] = stopped.get(outcome.listed, 0) + 1
    return compared, stopped


@needs_vllm
@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_minipaged_behaves_as_vllm_but_for_the_listed_differences(vllm, caching):
    compared, stopped = sweep(vllm, caching, set(diff.read_table()))
    print(f"vLLM {VERSION}, prefix caching {'on' if caching else 'off'}: {compared:,} operations "
          f"compared over {len(SEEDS)} runs; runs stopped at a listed difference: {stopped}")
    assert compared >= len(SEEDS) * NUM_OPS // 4  # the sequences mostly run before stopping


def first_failure(vllm, caching: bool, allowed: set[str]) -> str:
    for seed in SEEDS:
        ops = diff.random_ops(seed, NUM_OPS)
        if diff.run(vllm, ops, caching, pool_size(seed), allowed).failure is not None:
            return diff.report(vllm, ops, caching, pool_size(seed), allowed)
    return ""


@needs_vllm
def test_a_difference_not_in_the_table_fails(vllm):
    allowed = set(diff.read_table()) - {"no_free_blocks_error"}
    found = first_failure(vllm, True, allowed)
    assert "get_new_blocks(more than free) raised: vLLM 'ValueError'" in found, found
    assert "dry(" in found.splitlines()[-2], found  # the shortest sequence ends at the dry op


@needs_vllm
def test_a_planted_bug_is_caught_and_shrunk(vllm, monkeypatch):
    # The prefix pool frees every block to the tail, as chapter 3's pool does.
    monkeypatch.setattr(PrefixCachingBlockPool, "_free_blocks",
                        PrefixCachingBlockPool.__mro__[1]._free_blocks)
    found = first_failure(vllm, True, set(diff.read_table()))
    assert "free queue" in found, found
    length = int(found.split("shortest failing sequence (")[1].split(" ")[0])
    assert length <= 4, found  # admit, finish: the freed partial block lands at the wrong end
    print(found)


@needs_vllm
def test_a_falsy_success_is_caught(vllm, monkeypatch):
    monkeypatch.setattr(NoNewBlocks, "__bool__", lambda self: False)
    found = first_failure(vllm, False, set(diff.read_table()))
    assert "allocate_slots: truthiness differs" in found, found


@needs_vllm
def test_counting_a_preempted_request_as_new_is_caught(vllm, monkeypatch):
    record = PrefixCacheStats.record
    monkeypatch.setattr(PrefixCacheStats, "record",
                        lambda self, tokens, hits, preempted: record(self, tokens, hits, False))
    found = first_failure(vllm, True, set(diff.read_table()))
    assert "prefix-cache counters" in found and "resume(" in found, found
