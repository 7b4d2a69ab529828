"""bench/engine.py's headline ratio, A/B: this checkout against another (an earlier commit).

Each side runs in a fresh process, from its own checkout (``PYTHONPATH`` set to it): minipaged's
``LLM.generate`` and transformers' padded batch (sdpa) on bench/engine.py's workload, one untimed
run each, then ``--repeats`` runs each, interleaved. The sides take turns for ``--rounds`` rounds
at every thread count, the order reversed every other round, so that other jobs on a shared
machine weigh on both alike. Reported per side: the fastest and the median run of each engine,
and the ratio padded / minipaged of the fastest runs and of the medians. Then the host's share of
a decode step, before and after: each process serves the workload once more step by step
(``schedule`` then ``execute``, as ``LLMEngine.step`` does) and, at every decode step, times the
step's ``prepare_inputs`` and its ``plan_batched_attention`` again on the same inputs, alone,
keeping the fastest of ``HOST_REPEATS`` calls of each (the Python and NumPy that build a step's
metadata and plan, without the model); reported as the mean over decode steps, beside the
median decode step. Nothing is asserted.

    git worktree add /tmp/base <commit>
    python bench/engine_ab.py --base /tmp/base          # prints the table
    python bench/engine_ab.py --base /tmp/base --csv    # also writes bench/results/engine_ab.csv
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIELDS = ["threads", "side", "checkout", "processes", "runs", "minipaged_best_s",
          "minipaged_median_s", "padded_best_s", "padded_median_s", "ratio_best", "ratio_median",
          "prepare_inputs_us", "plan_us", "decode_step_ms", "answers_equal", "machine"]
HOST_REPEATS = 20  # calls of prepare_inputs and of the plan per decode step; the fastest kept


def fastest(call, *args) -> float:
    """The fastest of HOST_REPEATS calls of call(*args), in seconds."""
    times = []
    for _ in range(HOST_REPEATS):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return min(times)


def host_times(minipaged) -> dict:
    """The workload served once more, step by step: each decode step's prepare_inputs and plan
    timed alone on that step's inputs (fastest of HOST_REPEATS), and the decode step itself."""
    from minipaged.kernels import plan_batched_attention

    engine = minipaged.llm.llm_engine
    for i, (prompt, params) in enumerate(zip(minipaged.prompts, minipaged.params)):
        engine.add_request(f"host-{i}", prompt["prompt_token_ids"], params)
    found = {"prepare": [], "plan": [], "step": []}
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        decode = out.total_num_scheduled_tokens == len(out.scheduled_requests)
        if decode:
            _, metadata = engine.prepare_inputs(out)
            found["prepare"].append(fastest(engine.prepare_inputs, out))
            found["plan"].append(fastest(plan_batched_attention, metadata.block_tables,
                                         metadata.seq_lens, metadata.query_start_loc,
                                         metadata.block_size))
        start = time.perf_counter()
        engine.execute(out)
        if decode:
            found["step"].append(time.perf_counter() - start)
    return dict(prepare_us=1e6 * statistics.fmean(found["prepare"]),
                plan_us=1e6 * statistics.fmean(found["plan"]),
                step_ms=1e3 * statistics.median(found["step"]))


def one_side(threads: int, repeats: int) -> dict:
    """In a fresh process, from the checkout on PYTHONPATH: the two engines' run times."""
    import torch
    import transformers

    # This process must import the checkout on PYTHONPATH (the base of the A/B), so it is run
    # by path, as bench/blocks_commits.py runs its own, and takes bench/engine.py from here.
    sys.path.insert(0, str(HERE))
    from engine import Minipaged, PaddedBatch, workload

    from minipaged.huggingface import to_transformers
    from minipaged.model import ModelConfig, random_model

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    config = ModelConfig.small(num_layers=2)
    model = random_model(config, seed=0)
    prompts, answers = workload(config.vocab_size)
    engines = {"minipaged": Minipaged("minipaged", model, prompts, answers),
               "padded": PaddedBatch("padded", to_transformers(model, "sdpa"), prompts, answers)}
    ours, theirs = (engine.run()[0] for engine in engines.values())
    times = {name: [] for name in engines}
    for round_ in range(repeats):
        for name in list(engines) if round_ % 2 == 0 else list(engines)[::-1]:
            start = time.perf_counter()
            engines[name].run()
            times[name].append(time.perf_counter() - start)
    return dict(times=times, equal=sum(a == b for a, b in zip(ours, theirs)),
                host=host_times(engines["minipaged"]))


def main() -> None:
    from engine import add_machine_option, machine_note  # bench/engine.py, beside this file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the other checkout (a git worktree of the old commit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_machine_option(parser)
    parser.add_argument("--csv", action="store_true", help="write bench/results/engine_ab.csv")
    # a child process's threads and repeats
    parser.add_argument("--side", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(*args.side)))
        return
    if not args.base:
        parser.error("--base is required")
    sides = {"base": Path(args.base).resolve(), "this": HERE.parent}
    found = {(t, s): [] for t in args.threads for s in sides}
    for threads in args.threads:
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                env = dict(os.environ, PYTHONPATH=str(sides[side]))
                out = subprocess.run([sys.executable, __file__, "--side", str(threads),
                                      str(args.repeats)], cwd=sides[side], env=env,
                                     capture_output=True, text=True, check=True)
                found[threads, side].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"{threads} thread(s), round {round_ + 1}, {side}: "
                      f"{found[threads, side][-1]['times']}", flush=True)
    machine = machine_note(args.machine)
    rows = []
    for (threads, side), results in found.items():
        ours = [t for r in results for t in r["times"]["minipaged"]]
        theirs = [t for r in results for t in r["times"]["padded"]]
        rows.append(dict(
            threads=threads, side=side, checkout=str(sides[side]), processes=len(results),
            runs=len(ours), minipaged_best_s=round(min(ours), 4),
            minipaged_median_s=round(statistics.median(ours), 4),
            padded_best_s=round(min(theirs), 4),
            padded_median_s=round(statistics.median(theirs), 4),
            ratio_best=round(min(theirs) / min(ours), 3),
            ratio_median=round(statistics.median(theirs) / statistics.median(ours), 3),
            prepare_inputs_us=round(min(r["host"]["prepare_us"] for r in results), 1),
            plan_us=round(min(r["host"]["plan_us"] for r in results), 1),
            decode_step_ms=round(min(r["host"]["step_ms"] for r in results), 3),
            answers_equal=min(r["equal"] for r in results), machine=machine))
        print(rows[-1])
    if args.csv:
        from engine import write_results
        write_results("engine_ab.csv", FIELDS, rows)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
