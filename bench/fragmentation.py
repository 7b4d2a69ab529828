"""How fast chapter 2's simulator plays a trace through each allocator, on the seed's pool.

For 10,000, 100,000 and 1,000,000 requests at one offered load (1.0 by default: the pool full
on average, where exact fit has the most gaps to search), this times ``simulate`` for the
max-length reservation, exact fit (first and best fit) and blocks of 16 over the 929,024-token
pool, on one CPU core. It reports requests simulated per second and microseconds per request;
a cost that grows about linearly shows up as a flat microseconds-per-request column. Trace
generation is timed apart; refusal rates count the whole trace, warm-up included. The CSV goes
to bench/results/fragmentation.csv.

    python -m bench.fragmentation            # 10k, 100k and 1M requests
    python -m bench.fragmentation --quick    # 10k only, to check the script runs
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from minipaged.fragmentation import (
    STUDY_POOL_TOKENS,
    BlockAllocator,
    ExactFit,
    MaxLengthReservation,
    arrival_rate_for_load,
    make_workload,
    simulate,
)

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ("allocator", "num_requests", "load", "pool_tokens", "seconds", "requests_per_s",
          "us_per_request", "refusal_rate", "trace_seconds")


def allocators(pool_tokens: int):
    """The allocators timed, fresh for each run."""
    best = ExactFit(pool_tokens, fit="best")
    best.name = "exact fit (best)"
    return [MaxLengthReservation(pool_tokens), ExactFit(pool_tokens), best,
            BlockAllocator(pool_tokens, 16)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10,000 requests only")
    parser.add_argument("--load", type=float, default=1.0, help="offered load (default 1.0)")
    parser.add_argument("--out", type=Path, default=RESULTS / "fragmentation.csv")
    args = parser.parse_args()
    sizes = (10_000,) if args.quick else (10_000, 100_000, 1_000_000)
    rate = arrival_rate_for_load(args.load, STUDY_POOL_TOKENS)
    rows = []
    for num_requests in sizes:
        start = time.perf_counter()
        trace = make_workload(num_requests, rate, seed=0)
        trace_seconds = time.perf_counter() - start
        for allocator in allocators(STUDY_POOL_TOKENS):
            start = time.perf_counter()
            result = simulate(trace, allocator)  # refusals over the whole trace, warm-up included
            seconds = time.perf_counter() - start
            rows.append({
                "allocator": allocator.name, "num_requests": num_requests, "load": args.load,
                "pool_tokens": STUDY_POOL_TOKENS, "seconds": round(seconds, 4),
                "requests_per_s": round(num_requests / seconds),
                "us_per_request": round(1e6 * seconds / num_requests, 2),
                "refusal_rate": round(result.refusal_rate, 5),
                "trace_seconds": round(trace_seconds, 4),
            })
            row = rows[-1]
            print(f"{row['allocator']:18} {num_requests:>10,} requests {seconds:8.2f} s "
                  f"{row['requests_per_s']:>12,} req/s {row['us_per_request']:8.2f} us/req "
                  f"refused {row['refusal_rate']:7.2%}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nload {args.load}, pool {STUDY_POOL_TOKENS:,} tokens; wrote {args.out}")
    print(f"{'allocator':18}" + "".join(f"{n:>14,}" for n in sizes) + "   (us per request)")
    for name in dict.fromkeys(row["allocator"] for row in rows):
        cells = [row["us_per_request"] for row in rows if row["allocator"] == name]
        print(f"{name:18}" + "".join(f"{c:14.2f}" for c in cells))


if __name__ == "__main__":
    main()
