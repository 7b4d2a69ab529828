"""Speed of prefix caching (chapter 8): what a lookup costs, and what a hit on a free block costs.

1. Lookup cost per prompt length: hashing every full block of a new prompt (SHA-256 over the
   chapter's byte layout) plus walking the hash -> block map, on a manager whose cache already
   holds the prompt, so that every lookup is a hit.
2. A hit on a free cached block, from 1k to 1M blocks: minipaged takes the block out of the middle
   of its doubly linked free queue (O(1)) and gives it back. The peer is the structure nano-vllm's
   BlockManager uses, rebuilt from its public design (nano-vllm is not on the package registries):
   a deque of free block ids from which a hit does `deque.remove(block_id)`, O(n).

Interleaved repeats (minipaged and the peer alternate), min and median reported. Never asserted.
Writes bench/results/prefix_cache.csv and prints a table.
"""
from __future__ import annotations

import csv
import random
import statistics
import time
from collections import deque
from pathlib import Path

from minipaged.prefix_cache import (
    PrefixCachingBlockPool,
    PrefixCachingKVCacheManager,
    update_block_hashes,
)
from minipaged.sampling import SamplingParams
from minipaged.scheduler import Request

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_cache.csv"
PROMPT_LENGTHS = [128, 512, 2048, 8192]
POOL_SIZES = [1_000, 10_000, 100_000, 1_000_000]
REPEATS = 7
HITS = 200


def lookup_seconds(manager: PrefixCachingKVCacheManager, prompt: list[int]) -> float:
    """Seconds to hash a fresh request's prompt and find its cached blocks."""
    request = Request("probe", prompt, SamplingParams())
    start = time.perf_counter()
    update_block_hashes(request, manager.block_size)
    blocks, _ = manager.get_computed_blocks(request)
    elapsed = time.perf_counter() - start
    assert len(blocks) == (len(prompt) - 1) // manager.block_size
    return elapsed


def bench_lookups(rng: random.Random) -> list[dict]:
    rows = []
    for length in PROMPT_LENGTHS:
        pool = PrefixCachingBlockPool(num_blocks=length // 16 + 8, block_size=16)
        manager = PrefixCachingKVCacheManager(pool)
        prompt = [rng.randrange(151_936) for _ in range(length)]
        owner = Request("owner", prompt, SamplingParams())
        assert manager.allocate_slots(owner, length) is not None  # caches every full block
        times = [lookup_seconds(manager, prompt) for _ in range(REPEATS)]
        rows.append({"benchmark": "lookup", "size": length, "engine": "minipaged",
                     "min_us": 1e6 * min(times), "median_us": 1e6 * statistics.median(times),
                     "per_block_us": 1e6 * min(times) / (length // 16)})
    return rows


def minipaged_hits(pool: PrefixCachingBlockPool, victims: list) -> float:
    """Seconds for HITS hits on free blocks anywhere in the queue, each given back at once."""
    start = time.perf_counter()
    for block in victims:
        pool.touch([block])  # out of the middle of the free queue
        pool.free_blocks([block])  # and back, still cached
    return time.perf_counter() - start


def deque_hits(queue: deque, victims: list[int]) -> float:
    """The same hits as nano-vllm's BlockManager makes them: deque.remove, then append."""
    start = time.perf_counter()
    for block_id in victims:
        queue.remove(block_id)
        queue.append(block_id)
    return time.perf_counter() - start


def bench_hits(rng: random.Random) -> list[dict]:
    rows = []
    for num_blocks in POOL_SIZES:
        pool = PrefixCachingBlockPool(num_blocks=num_blocks, block_size=16)
        for block in pool.blocks:  # every block cached and free: each hit is on a free block
            block.block_hash = block.block_id.to_bytes(32, "little")
            pool.cached_block_hash_to_block[block.block_hash] = block
        queue = deque(range(num_blocks))
        times = {"minipaged": [], "deque.remove (nano-vllm's structure)": []}
        for _ in range(REPEATS):  # interleaved: the two alternate, same victims each round
            ids = rng.sample(range(num_blocks), HITS)
            times["minipaged"].append(minipaged_hits(pool, [pool.blocks[i] for i in ids]))
            times["deque.remove (nano-vllm's structure)"].append(deque_hits(queue, ids))
        for engine, seconds in times.items():
            rows.append({"benchmark": "hit on a free block", "size": num_blocks, "engine": engine,
                         "min_us": 1e6 * min(seconds) / HITS,
                         "median_us": 1e6 * statistics.median(seconds) / HITS,
                         "per_block_us": ""})
    return rows


def main() -> None:
    rng = random.Random(0)
    rows = bench_lookups(rng) + bench_hits(rng)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.3f}" if isinstance(v, float) else v)
                             for k, v in row.items()})
    print(f"{'benchmark':22} {'size':>9} {'engine':38} {'min us':>10} {'median us':>10}")
    for row in rows:
        print(f"{row['benchmark']:22} {row['size']:>9,} {row['engine']:38} "
              f"{row['min_us']:>10.2f} {row['median_us']:>10.2f}")
    print(f"lookup: a whole prompt; hit: per hit. Min and median of {REPEATS} interleaved repeats.")


if __name__ == "__main__":
    main()
