"""vLLM's own FreeKVCacheBlockQueue, BlockPool and KVCacheManager beside minipaged's.

Runs under ``make vllm-check``, which fetches the release named by VLLM_VERSION (see
tools/vllm_check.py) and sets the variable; without it the tests that need vLLM are skipped. The
harness is tests/vllm_differential.py, the loader and its stubs tests/vllm_release.py, and the
differences allowed are the rows of book/vllm_differences.csv, which the book shows.
"""
from __future__ import annotations

import os
import random

import pytest
import vllm_differential as diff  # noqa: E402  (tests/, which pytest puts on sys.path)

from minipaged.blocks import KVCacheBlock  # noqa: E402
from minipaged.prefix_cache import (  # noqa: E402
    EvictionOrderQueue,
    PrefixCacheStats,
    PrefixCachingBlockPool,
)
from minipaged.scheduler import NoNewBlocks  # noqa: E402

VERSION = os.environ.get("VLLM_VERSION")
needs_vllm = pytest.mark.skipif(not VERSION, reason="needs a vLLM release: make vllm-check")
SEEDS = range(int(os.environ.get("VLLM_DIFF_SEEDS", "400")))
NUM_OPS = 200


@pytest.fixture(scope="module")
def vllm():
    import vllm_release

    from tools import vllm_check
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


def queue_ops(seed: int, n: int = 60) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(rng.choice(["popleft", "popleft_n", "remove", "append", "append_n", "prepend_n"]),
             rng.randrange(1 << 16)) for _ in range(n)]


def drive_queue(vllm, ops: list[tuple[str, int]], num_blocks: int = 12) -> str | None:
    """Apply ops to vLLM's FreeKVCacheBlockQueue and chapter 8's EvictionOrderQueue (chapter
    3's queue and prepend_n) over blocks numbered alike; the first divergence, or None. An
    operation that has nothing to work on (an empty queue, no block outside it) is skipped."""
    vblocks = [vllm.utils.KVCacheBlock(i) for i in range(num_blocks)]
    mblocks = [KVCacheBlock(i) for i in range(num_blocks)]
    vq, mq = vllm.utils.FreeKVCacheBlockQueue(list(vblocks)), EvictionOrderQueue(list(mblocks))
    for index, (name, pick) in enumerate(ops):
        queued = [b.block_id for b in mq]
        outside = [i for i in range(num_blocks) if i not in queued]
        if name in ("popleft", "popleft_n", "remove") and not queued or \
                name in ("append", "append_n", "prepend_n") and not outside:
            continue
        if name == "popleft":
            got = (vq.popleft().block_id, mq.popleft().block_id)
        elif name == "popleft_n":
            k = 1 + pick % len(queued)
            got = ([b.block_id for b in vq.popleft_n(k)], [b.block_id for b in mq.popleft_n(k)])
        elif name == "remove":
            i = queued[pick % len(queued)]
            vq.remove(vblocks[i])
            mq.remove(mblocks[i])
            got = None
        else:
            chosen = random.Random(pick).sample(outside, 1 if name == "append" else
                                                1 + pick % len(outside))
            if name == "append":
                vq.append(vblocks[chosen[0]])
                mq.append(mblocks[chosen[0]])
            else:
                getattr(vq, name)([vblocks[i] for i in chosen])
                getattr(mq, name)([mblocks[i] for i in chosen])
            got = None
        if got is not None and got[0] != got[1]:
            return f"operation {index} {name}: vLLM took {got[0]}, minipaged {got[1]}"
        vorder = [b.block_id for b in vq.get_all_free_blocks()]
        morder = [b.block_id for b in mq]
        if vorder != morder or vq.num_free_blocks != mq.num_free_blocks:
            return f"operation {index} {name}: queue vLLM {vorder}, minipaged {morder}"
    return None


@needs_vllm
def test_the_free_queue_moves_as_vllms(vllm):
    for seed in SEEDS:
        ops = queue_ops(seed)
        failure = drive_queue(vllm, ops)
        if failure is not None:
            while len(ops) > 1 and drive_queue(vllm, ops[:-1]) is not None:
                ops = ops[:-1]  # the shortest prefix that still fails
            pytest.fail(f"seed {seed}: {drive_queue(vllm, ops)}\n{ops}", pytrace=False)


@needs_vllm
def test_a_queue_that_prepends_in_reverse_is_caught(vllm, monkeypatch):
    prepend_n = EvictionOrderQueue.prepend_n
    monkeypatch.setattr(EvictionOrderQueue, "prepend_n",
                        lambda self, blocks: prepend_n(self, blocks[::-1]))
    assert any("prepend_n" in (drive_queue(vllm, queue_ops(seed)) or "") for seed in SEEDS)
