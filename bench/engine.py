"""minipaged's engine against transformers' generate on one mixed-length workload, on a CPU.

One random Qwen2 with Qwen2.5-0.5B's attention geometry (chapter 6's small preset, 2 layers)
answers 32 prompts of 8 to 249 tokens, each asking for 8 to 128 new tokens (lengths drawn with
a fixed seed), greedy. The same weights run in every engine:

* minipaged's ``LLM.generate``, with ``attention_backend="auto"`` (on a CPU, chapter 5's batched
  path) and, for comparison, with chapter 4's per-sequence reference (``"torch"``);
* transformers' ``Qwen2ForCausalLM.generate`` on the whole batch at once, left-padded to the
  longest prompt and run until the longest answer is done, with its default attention (sdpa)
  and with eager attention;
* transformers' ``generate`` with sdpa, one prompt at a time, each for its own answer length.

Throughput counts the requested tokens only (the padded batch computes more, and that is its
cost). Every timed run has a fresh process of its own: the process builds its engine, runs it
once untimed, then once timed. One process running every engine in turn would let one engine's
allocations weigh on the next (glibc's allocator keeps a history, chapter 5.2): run that way, the
engine's fastest run at 2 threads came out slower than at 1. The engines take turns for
``--repeats`` rounds, the order reversed on every other round so that a machine drifting slower
or faster favours no one; the fastest and the median run are reported, at 1 and 2 threads
(``torch.set_num_threads``), by the wall clock and by the process's CPU time. On a shared
machine the wall clock also counts the time other jobs held the cores; CPU time counts only what
the process itself spent (summed over its threads, so at 2 threads it measures work, not
latency).

Cache bytes: for minipaged, *reserved* is the KV tensors the engine allocated and *used* the
most blocks in use at once times the bytes of a block; for transformers, the tensors of its cache
when the batch ends (the padded batch's cache holds batch x (longest prompt + longest answer)
positions; one prompt at a time, the largest single cache). Every engine's greedy answers are
compared with minipaged's. Timings are reported, never asserted.

The goal, reported and never asserted: minipaged at least 3x as fast as transformers' padded
batch (sdpa) at 1 and at 2 threads, prefix caching off. Where a step's time goes is
bench/step_breakdown.py's job (same workload, same engine, step by step under torch's profiler).

    python -m bench.engine             # the full run that bench/results/engine.csv holds
    python -m bench.engine --quick     # 1 round at 1 thread, no CSV, to check that it runs
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from minipaged import LLM, SamplingParams
from minipaged.huggingface import to_transformers
from minipaged.model import ModelConfig, random_model

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["threads", "engine", "repeats", "requested_tokens", "best_s", "median_s",
          "best_tokens_per_s", "median_tokens_per_s", "minipaged_speedup_best",
          "minipaged_speedup_median", "best_cpu_s", "median_cpu_s", "minipaged_cpu_speedup_median",
          "cache_reserved_bytes", "cache_used_bytes", "answers_equal", "shortest_prompt",
          "longest_prompt", "shortest_answer", "longest_answer", "machine"]


def workload(vocab_size: int, num_prompts: int = 32, seed: int = 0):
    """Prompts of 8-249 random tokens and answer lengths of 8-128, fixed by the seed."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 250, num_prompts).tolist()
    answers = rng.integers(8, 129, num_prompts).tolist()
    prompts = [rng.integers(1, vocab_size, n).tolist() for n in lengths]
    return prompts, answers


def cache_bytes(out) -> int:
    """Bytes held by the key and value tensors of the cache that generate returned in `out`
    (``out.cache`` since transformers 5.24, ``out.past_key_values`` before)."""
    cache = getattr(out, "cache", None) or out.past_key_values
    total = 0
    for layer in getattr(cache, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


class Minipaged:
    """minipaged's LLM on the workload; answers and cache bytes from its last run."""

    def __init__(self, name, model, prompts, answers):
        self.name, self.prompts = name, [{"prompt_token_ids": p} for p in prompts]
        self.params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                       for n in answers]
        self.llm = LLM(model=model, max_model_len=model.config.max_position_embeddings,
                       enable_prefix_caching=False)  # no prefix cache: random prompts share none

    def run(self):
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        engine = self.llm.llm_engine
        per_token = engine.config.model_shape(engine.kv_cache.layers[0].element_size())
        used = engine.stats()["peak_num_used_blocks"] * engine.pool.block_size
        return ([o.outputs[0].token_ids for o in outputs], engine.kv_cache.num_bytes,
                used * per_token.kv_bytes_per_token)


class PaddedBatch:
    """transformers' generate on the whole batch, left-padded, until the longest answer ends."""

    def __init__(self, name, peer, prompts, answers):
        self.name, self.peer, self.answers = name, peer, answers
        longest = max(len(p) for p in prompts)
        self.ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        self.mask = torch.zeros_like(self.ids)
        for row, prompt in enumerate(prompts):  # left padding, as batched generation needs
            self.ids[row, longest - len(prompt):] = torch.tensor(prompt)
            self.mask[row, longest - len(prompt):] = 1

    @torch.no_grad()
    def run(self):
        out = self.peer.generate(self.ids, attention_mask=self.mask, do_sample=False,
                                 max_new_tokens=max(self.answers), eos_token_id=None,
                                 pad_token_id=0, return_dict_in_generate=True)
        new = out.sequences[:, self.ids.shape[1]:].tolist()
        held = cache_bytes(out)
        return [row[:n] for row, n in zip(new, self.answers)], held, held


class OneAtATime:
    """transformers' generate on each prompt alone, for its own answer length."""

    def __init__(self, name, peer, prompts, answers):
        self.name, self.peer, self.prompts, self.answers = name, peer, prompts, answers

    @torch.no_grad()
    def run(self):
        tokens, largest = [], 0
        for prompt, n in zip(self.prompts, self.answers):
            out = self.peer.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                     eos_token_id=None, pad_token_id=0,
                                     return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            largest = max(largest, cache_bytes(out))
        return tokens, largest, largest


ENGINES = ["minipaged", "minipaged, reference attention", "transformers padded batch, sdpa",
           "transformers padded batch, eager", "transformers one prompt at a time, sdpa"]


def make_engine(name: str, prompts, answers):
    """One engine of ENGINES over chapter 6's small Qwen2 (2 layers), the same weights in all."""
    config = ModelConfig.small(num_layers=2)
    backend = "torch" if name == "minipaged, reference attention" else "auto"
    model = random_model(config, seed=0, attention_backend=backend)  # "auto": batched on a CPU
    if name.startswith("minipaged"):
        return Minipaged(name, model, prompts, answers)
    attention = "eager" if name.endswith("eager") else "sdpa"
    kind = OneAtATime if "one prompt at a time" in name else PaddedBatch
    return kind(name, to_transformers(model, attention), prompts, answers)


def one_run(name: str, threads: int) -> dict:
    """In a fresh process: build one engine, run it untimed, then time one run."""
    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()  # generate's per-call notices
    prompts, answers = workload(ModelConfig.small(num_layers=2).vocab_size)
    engine = make_engine(name, prompts, answers)
    tokens, reserved, used = engine.run()  # untimed: answers and cache bytes
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.run()
    return dict(seconds=time.perf_counter() - start, cpu=time.process_time() - cpu_start,
                tokens=tokens, reserved=reserved, used=used)


def in_fresh_process(name: str, threads: int) -> dict:
    """one_run in a child process of this script, from this checkout."""
    out = subprocess.run([sys.executable, "-m", "bench.engine", "--one", name, str(threads)],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def add_machine_option(parser: argparse.ArgumentParser) -> None:
    """The --machine option of every bench that writes a CSV: its note, for machine_note."""
    parser.add_argument("--machine", default="",
                        help="a note on the machine for the CSV, after the CPU's model and "
                        "cores, e.g. 'no other job running'")


def machine_note(note: str = "") -> str:
    """The CSVs' machine column: the CPU's model and the cores this process may use, then the
    note given on the command line (what else was running, say)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), "") \
        if Path("/proc/cpuinfo").exists() else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ", ".join(part for part in (model or platform.machine(), f"{cores} cores", note)
                     if part)


def measure(names: list[str], repeats: int, threads: int, requested: int, machine: str = ""
            ) -> list[dict]:
    """`repeats` rounds of one fresh process per engine, taking turns, the order alternating."""
    runs = {name: [] for name in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            runs[name].append(in_fresh_process(name, threads))
        print(f"  {threads} thread(s), round {round_ + 1}/{repeats}: "
              + ", ".join(f"{n} {r[-1]['seconds']:.2f}s" for n, r in runs.items() if r),
              flush=True)
    ours = runs[names[0]]
    ours_best = min(r["seconds"] for r in ours)
    ours_median = statistics.median(r["seconds"] for r in ours)
    ours_cpu = statistics.median(r["cpu"] for r in ours)
    rows = []
    for name in names:
        times, cpu = [r["seconds"] for r in runs[name]], [r["cpu"] for r in runs[name]]
        first = runs[name][0]
        best, median = min(times), statistics.median(times)
        equal = min(sum(a == b for a, b in zip(r["tokens"], ours[0]["tokens"]))
                    for r in runs[name])  # every run's answers, against minipaged's first
        rows.append(dict(
            threads=threads, engine=name, repeats=repeats, requested_tokens=requested,
            best_s=round(best, 4), median_s=round(median, 4),
            best_tokens_per_s=round(requested / best, 1),
            median_tokens_per_s=round(requested / median, 1),
            minipaged_speedup_best=round(best / ours_best, 3),
            minipaged_speedup_median=round(median / ours_median, 3),
            best_cpu_s=round(min(cpu), 4), median_cpu_s=round(statistics.median(cpu), 4),
            minipaged_cpu_speedup_median=round(statistics.median(cpu) / ours_cpu, 3),
            cache_reserved_bytes=first["reserved"], cache_used_bytes=first["used"],
            answers_equal=f"{equal}/{len(first['tokens'])}", machine=machine))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 1 thread, no CSV")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_machine_option(parser)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # a child: engine, threads
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], int(args.one[1]))))
        return
    repeats, threads = (1, [1]) if args.quick else (args.repeats, args.threads)
    prompts, answers = workload(ModelConfig.small(num_layers=2).vocab_size)
    requested = sum(answers)
    lengths = [len(p) for p in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, answers of "
          f"{min(answers)}-{max(answers)} tokens ({requested} requested), greedy; "
          f"{repeats} rounds at {threads} thread(s), a fresh process for every run")
    start = time.perf_counter()
    machine = machine_note(args.machine)
    drawn = dict(shortest_prompt=min(lengths), longest_prompt=max(lengths),
                 shortest_answer=min(answers), longest_answer=max(answers))  # for the chapters
    rows = [dict(row, **drawn) for n in threads
            for row in measure(ENGINES, repeats, n, requested, machine)]
    for row in rows:
        print(f"{row['threads']} thr  {row['engine']:42} best {row['best_tokens_per_s']:8,.0f} "
              f"median {row['median_tokens_per_s']:8,.0f} tok/s  minipaged x"
              f"{row['minipaged_speedup_median']:.2f} (median; CPU time x"
              f"{row['minipaged_cpu_speedup_median']:.2f})  cache reserved "
              f"{row['cache_reserved_bytes'] / 2**20:7.1f} MiB, used "
              f"{row['cache_used_bytes'] / 2**20:6.1f} MiB  answers {row['answers_equal']}")
    for row in rows:
        if row["engine"] == "transformers padded batch, sdpa":
            print(f"goal >= 3x the padded batch (sdpa), prefix caching off, {row['threads']} "
                  f"thread(s): x{row['minipaged_speedup_best']:.2f} fastest runs, "
                  f"x{row['minipaged_speedup_median']:.2f} medians")
    print(f"measured in {time.perf_counter() - start:.0f} s")
    if not args.quick:
        write_results("engine.csv", FIELDS, rows)


def write_results(name: str, fields: list[str], rows: list[dict]) -> None:
    """Write rows to bench/results/<name> as CSV (this script's and its neighbours' results)."""
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / name, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
