"""What bench/cpu_decode.cpp would be worth to the engine: bench/engine.py's run, decodes in C++.

Chapter 5.2 times the C++ decode (bench/cpu_attention.py) on one layer of one decode step, where
it beats the gathers. This script asks what that is worth to a whole run, the road the package
did not take. Two sides serve bench/engine.py's workload (minipaged's ``LLM.generate``, prefix
caching off, greedy), each run in a fresh process that runs it once untimed and once timed:

* **batched**: the engine as it is;
* **C++ decode**: the same engine, with ``minipaged.kernels.batched_paged_attention`` replaced,
  in that process only, by a version that sends every decode group to the C++ decode (its
  contexts read from the group's mask) and every other group to the original.

The extension is built once, before the runs, into one folder that every process loads. The
sides take turns for ``--rounds`` rounds, the order reversed every other round, at 1 and 2
threads; the fastest and the median run are kept, and each side's answers are compared with the
batched side's. Timings are reported, never asserted.

    python -m bench.cpp_decode_engine          # writes bench/results/cpp_decode_engine.csv
    python -m bench.cpp_decode_engine --quick  # 1 round at 1 thread, no CSV
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import add_machine_option, machine_note, write_results

FIELDS = ["threads", "side", "processes", "best_s", "median_s", "speedup_best",
          "speedup_median", "answers_equal", "machine"]
SIDES = ["batched", "C++ decode"]
SOURCE = Path(__file__).with_name("cpu_decode.cpp")


def build(folder: str):
    """bench/cpu_decode.cpp, built into `folder` (or loaded from it when already built)."""
    from torch.utils.cpp_extension import load
    return load("cpu_decode", [str(SOURCE)], build_directory=folder,
                extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)


def decodes_in_cpp(extension, original):
    """batched_paged_attention with its decode groups sent to the C++ decode."""
    from minipaged.kernels import BatchedPlan

    def attention(query, kv_cache_layer, plan, scale=None):
        scale = query.shape[2] ** -0.5 if scale is None else scale
        decodes = [g for g in plan.groups if g.tokens.shape[1] == 1]
        others = BatchedPlan(tuple(g for g in plan.groups if g.tokens.shape[1] > 1),
                             plan.block_size)
        output = (original(query, kv_cache_layer, others, scale) if others.groups
                  else torch.empty_like(query))
        for group in decodes:
            contexts = (group.mask[:, 0, 0] == 0).sum(-1)  # a decode attends to its context
            output.index_copy_(0, group.real_tokens, extension.paged_decode(
                query[group.real_tokens].contiguous(), kv_cache_layer,
                group.blocks.contiguous(), contexts, scale))
        return output
    return attention


def one_run(side: str, threads: int, folder: str) -> dict:
    """In a fresh process: one side's engine, run once untimed, then once timed."""
    from bench.engine import make_engine, workload
    from minipaged import kernels
    from minipaged.model import ModelConfig

    torch.set_num_threads(threads)
    if side == "C++ decode":
        kernels.batched_paged_attention = decodes_in_cpp(build(folder),
                                                         kernels.batched_paged_attention)
    prompts, answers = workload(ModelConfig.small(num_layers=2).vocab_size)
    engine = make_engine("minipaged", prompts, answers)
    tokens = engine.run()[0]
    start = time.perf_counter()
    engine.run()
    return dict(seconds=time.perf_counter() - start, tokens=tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round at 1 thread, no CSV")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_machine_option(parser)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # a child: side, threads, dir
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]), args.one[2])))
        return
    rounds, threads = (1, [1]) if args.quick else (args.rounds, args.threads)
    folder = tempfile.mkdtemp(prefix="cpu_decode_")
    build(folder)  # once, so that no timed process pays the build
    rows, machine = [], machine_note(args.machine)
    for n in threads:
        runs = {side: [] for side in SIDES}
        for round_ in range(rounds):
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                out = subprocess.run([sys.executable, "-m", "bench.cpp_decode_engine", "--one",
                                      side, str(n), folder], capture_output=True, text=True,
                                     check=True, cwd=Path(__file__).resolve().parents[1])
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{n} thread(s), round {round_ + 1}: {side} "
                      f"{runs[side][-1]['seconds']:.3f} s", flush=True)
        base = [r["seconds"] for r in runs["batched"]]
        for side in SIDES:
            times = [r["seconds"] for r in runs[side]]
            equal = min(sum(a == b for a, b in zip(r["tokens"], runs["batched"][0]["tokens"]))
                        for r in runs[side])
            rows.append(dict(threads=n, side=side, processes=len(times),
                             best_s=round(min(times), 4),
                             median_s=round(statistics.median(times), 4),
                             speedup_best=round(min(base) / min(times), 3),
                             speedup_median=round(statistics.median(base)
                                                  / statistics.median(times), 3),
                             answers_equal=f"{equal}/{len(runs['batched'][0]['tokens'])}",
                             machine=machine))
            print(rows[-1])
    if not args.quick:
        write_results("cpp_decode_engine.csv", FIELDS, rows)


if __name__ == "__main__":
    main()
