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

    python -m bench.blocks_commits                 # against d1c2c05, the code issue 25 was filed on
    python -m bench.blocks_commits --old HEAD~3 --rounds 2
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
PEER = "nano-vllm BlockManager (rebuilt)"  # bench/blocks.py's name for the peer


def child(tree: str, repeats: int, sizes: list[int]) -> None:
    """In a process of its own: tree's bench/blocks.py measures every stream; print JSON."""
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("tree_blocks", Path(tree) / "bench" / "blocks.py")
    blocks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(blocks)
    best = {}
    for num_blocks in sizes:  # the same seed per pool size as bench/blocks.py's main()
        for row in blocks.measure(num_blocks, repeats, random.Random(num_blocks)):
            best[f"{row['operation']}|{num_blocks}|{row['side']}"] = row["min_ns"]
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
        row = {"operation": operation, "num_blocks": int(num_blocks), "side": side,
               "old_commit": old_rev, "rounds": args.rounds, "repeats": args.repeats}
        for name in ("old", "new"):
            row[f"{name}_min_ns"] = round(best[name][key], 1)
            row[f"{name}_peer_min_ns"] = round(best[name][peer_key], 1)
            row[f"{name}_ratio"] = round(best[name][key] / best[name][peer_key], 3)
        rows.append(row)
        print(f"{operation:>20} {int(num_blocks):>9,} {side:>38}  "
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
