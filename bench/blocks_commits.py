"""bench/blocks.py's streams, run by an older commit's code and by this checkout's, in one sitting.

bench/results/blocks.csv compares minipaged with nano-vllm's BlockManager in one run. Whether a
change made minipaged's bookkeeping slower is a different question: the runs behind two versions
of that CSV were made on different days, and a shared machine drifts by more than the changes
being judged. So this script runs both versions side by side. The older commit's `minipaged/`
and `bench/` are unpacked (`git archive`) into a scratch folder; then processes take turns, one
with the old tree first on its path and one with this checkout's, `--rounds` times each. Every
process imports its own tree's `bench/blocks.py` and times each stream `--repeats` times, the
peer included (the peer's code is the same in both trees, so its times show how the machine
drifted between the processes).

Reported for every operation, pool size and minipaged side: the minimum over every process and
repeat of nanoseconds per operation, old and new, and each divided by the peer's minimum in
the same tree's processes. Written to bench/results/blocks_commits.csv and printed; never
asserted.

    python bench/blocks_commits.py                 # against d1c2c05, the code issue 25 was filed on
    python bench/blocks_commits.py --old HEAD~3 --rounds 2
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "blocks_commits.csv"
SIZES = [1_000, 10_000, 100_000]
PEER = "peer"


def streams(blocks, num_blocks: int) -> dict[tuple[str, str], object]:
    """The streams bench/blocks.py times, by (operation, side), for one pool size."""
    rng = random.Random(num_blocks)  # the same draws as bench/blocks.py's measure()
    window, lengths = blocks.churn_stream(num_blocks, rng)
    victims = blocks.hit_stream(num_blocks, rng)
    n = num_blocks
    return {
        ("churn", PEER): lambda: blocks.churn_peer(n, window, lengths),
        ("churn", "KVCacheManager"): lambda: blocks.churn_manager(n, window, lengths),
        ("churn", "BlockTable"): lambda: blocks.churn_table(n, window, lengths),
        ("decode step", PEER): lambda: blocks.step_peer(n),
        ("decode step", "KVCacheManager"): lambda: blocks.step_manager(n),
        ("decode step", "PrefixCachingKVCacheManager"): lambda: blocks.step_prefix_manager(n),
        ("decode step", "BlockTable"): lambda: blocks.step_table(n),
        ("decode growth", PEER): lambda: blocks.growth_peer(n),
        ("decode growth", "KVCacheManager"): lambda: blocks.growth_manager(n),
        ("decode growth", "BlockTable"): lambda: blocks.growth_table(n),
        ("hit on a free block", PEER): lambda: blocks.hit_peer(n, victims),
        ("hit on a free block", "PrefixCachingBlockPool"): lambda: blocks.hit_pool(n, victims),
    }


def child(tree: str, repeats: int, sizes: list[int]) -> None:
    """In a process of its own: time every stream of tree's bench/blocks.py, print JSON."""
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("tree_blocks", Path(tree) / "bench" / "blocks.py")
    blocks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blocks)
    best = {}
    for num_blocks in sizes:
        for (operation, side), run in streams(blocks, num_blocks).items():
            samples = [run() for _ in range(repeats)]  # (seconds, operations) each
            best[f"{operation}|{num_blocks}|{side}"] = min(1e9 * s / c for s, c in samples)
    print(json.dumps(best))


def unpack(rev: str, into: Path) -> None:
    """rev's minipaged/ and bench/ into the folder, as git archive gives them."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev,
                              "minipaged", "bench"], check=True, capture_output=True).stdout
    archive_path = into / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="data")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="d1c2c05", help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=4, help="processes per tree")
    parser.add_argument("--repeats", type=int, default=3, help="timings per stream per process")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--child", nargs=2, metavar=("TREE", "REPEATS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]), args.sizes)
    old_rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.old],
                             check=True, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        unpack(old_rev, Path(scratch))
        trees = {"old": scratch, "new": str(ROOT)}
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        for round_ in range(args.rounds):
            for name in ("old", "new") if round_ % 2 == 0 else ("new", "old"):  # take turns
                command = [sys.executable, __file__, "--child", trees[name], str(args.repeats),
                           "--sizes", *map(str, args.sizes)]
                out = subprocess.run(command, check=True, capture_output=True, text=True,
                                     env={**env, "PYTHONPATH": trees[name]}).stdout
                runs[name].append(json.loads(out))
                print(f"round {round_ + 1}: {name} done", flush=True)
    best = {name: {key: min(run[key] for run in done) for key in done[0]}
            for name, done in runs.items()}
    rows = []
    for key in best["old"]:
        operation, num_blocks, side = key.split("|")
        if side == PEER:
            continue
        peer_key = f"{operation}|{num_blocks}|{PEER}"
        row = {"operation": operation, "num_blocks": int(num_blocks), "side": f"minipaged {side}",
               "old_commit": old_rev, "rounds": args.rounds, "repeats": args.repeats}
        for name in ("old", "new"):
            row[f"{name}_min_ns"] = round(best[name][key], 1)
            row[f"{name}_peer_min_ns"] = round(best[name][peer_key], 1)
            row[f"{name}_ratio"] = round(best[name][key] / best[name][peer_key], 3)
        rows.append(row)
        print(f"{operation:>20} {int(num_blocks):>9,} {side:>28}  "
              f"old {row['old_min_ns']:>8,.1f} ns ({row['old_ratio']:.3f}x)  "
              f"new {row['new_min_ns']:>8,.1f} ns ({row['new_ratio']:.3f}x)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with RESULTS.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
