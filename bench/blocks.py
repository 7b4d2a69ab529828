"""Speed of the block pool (chapter 3): operations per second from 1k to 1M blocks.

Allocation (take from the head), free (return to the tail) and removal from the middle of the
free queue (a cache hit on a free block) should all be O(1): flat across pool sizes. A
collections.deque with deque.remove, the O(n) way, is measured beside them for contrast.
Reported, never asserted. Writes bench/results/blocks.csv and prints a table.
"""
from __future__ import annotations

import csv
import random
import time
from collections import deque
from pathlib import Path

from minipaged.blocks import BlockPool

SIZES = [1_000, 10_000, 100_000, 1_000_000]
OPS = 20_000
RESULTS = Path(__file__).resolve().parent / "results" / "blocks.csv"


def rate(run, count: int) -> float:
    """Operations per second of run(), which performs count operations."""
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def measure(num_blocks: int, rng: random.Random) -> dict[str, float]:
    pool = BlockPool(num_blocks=num_blocks, block_size=16)
    ops = min(OPS, num_blocks // 2)
    held: list = []
    rates = {"allocate": rate(lambda: [held.extend(pool.allocate(1)) for _ in range(ops)], ops)}
    rates["free"] = rate(lambda: [pool.free([block]) for block in held], ops)
    # held blocks went to the tail; pick free blocks anywhere in the queue
    middle = [pool.blocks[i] for i in rng.sample(range(num_blocks), ops)]
    rates["remove from middle"] = rate(lambda: [pool.incref([block]) for block in middle], ops)
    queue = deque(range(num_blocks))
    victims = rng.sample(range(num_blocks), min(200, ops))
    rates["deque.remove (O(n))"] = rate(lambda: [queue.remove(v) for v in victims], len(victims))
    return rates


def main() -> None:
    rng = random.Random(0)
    rows = []
    for num_blocks in SIZES:
        for operation, ops_per_second in measure(num_blocks, rng).items():
            rows.append({"num_blocks": num_blocks, "operation": operation,
                         "ops_per_second": round(ops_per_second)})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["num_blocks", "operation", "ops_per_second"])
        writer.writeheader()
        writer.writerows(rows)
    operations = list(dict.fromkeys(row["operation"] for row in rows))
    print(f"{'blocks':>10} " + " ".join(f"{op:>20}" for op in operations) + "   (operations/s)")
    for num_blocks in SIZES:
        values = {r["operation"]: r["ops_per_second"]
                  for r in rows if r["num_blocks"] == num_blocks}
        print(f"{num_blocks:>10,} " + " ".join(f"{values[op]:>20,}" for op in operations))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
