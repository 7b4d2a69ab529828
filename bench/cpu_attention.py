"""Three questions about chapter 5's batched CPU path, answered with numbers, on a CPU.

1. **From what length does the causal flag beat the pieces?** Prompts with nothing cached, one
   layer's attention through the batched path, gathers included, planned two ways: cut into
   pieces under their masks, and each prompt whole, one call with ``is_causal=True`` and no mask
   (``plan_batched_attention``'s ``causal_rows``, set past the prompts or below them). Cases:
   bench/engine.py's first mixed step (its first 2,048 prompt tokens: whole prompts of 8 to 249
   tokens and the first chunk of the next), and a sweep of equal prompts, as many of each
   length as fill that step's 2,048 tokens, from 256 to 2,048 tokens. The plan's own threshold,
   ``CAUSAL_ROWS``, is chosen from the sweep.  Each case's sequences, their tokens, and the
   shortest and longest sequence (a prompt's length, a decode's context) go to the CSV.
2. **Does a compiled decode beat the gathers?** One layer of a decode step of 16 sequences over
   contexts of 100 to 370 tokens, in a pool the size of bench/engine.py's, after one untimed run
   of the engine's first step (as in the engine, whose decodes come after its prompts' steps and
   so meet the allocator in the state those left it in): the batched path as it runs, against
   the same groups through ``torch.compile`` of the decode written as plain tensor code (the
   gather through the table, two products, the mask and the softmax). Inductor fuses the gather
   with the transpose the product needs, and the mask, scale and softmax into one loop; the
   products stay BLAS calls. The compile time (the first call, in a fresh process, with a
   fresh Inductor cache) is kept.
3. **Does reading the blocks in place beat the gathers?** The same decode step through a small
   C++ extension, bench/cpu_decode.cpp (built with ``torch.utils.cpp_extension.load``, g++ and
   ninja, ``-O3 -march=native -ffast-math``, into a fresh folder in every process, so that the
   build time is kept too): each position found through the table and read where it lies.

Every side runs in a fresh process (glibc's allocator history moves CPU timings), the sides take
turns for ``--rounds`` rounds, each process times ``--calls`` calls after one untimed call; the
CSV keeps each side's fastest and median call over all rounds, and the largest difference from
the batched path's output (for the prompts, from the pieces'). Timings are reported, never
asserted.

    python -m bench.cpu_attention            # writes bench/results/cpu_attention.csv
    python -m bench.cpu_attention --quick    # 1 round, no CSV
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import (  # bench/engine.py's note and CSV writer
    add_machine_option,
    machine_note,
    write_results,
)
from minipaged.frontend import FrontEndArgs
from minipaged.kernels import batched_paged_attention, plan_batched_attention, store_kv

FIELDS = ["case", "sequences", "tokens", "shortest", "longest", "side", "threads", "rounds",
          "calls", "best_ms", "median_ms", "compile_s", "equal_to_batched", "max_abs_diff",
          "machine"]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 14, 2, 64, 16  # Qwen2.5-0.5B's attention geometry
POOL_BLOCKS = 8192  # bench/engine.py's pool: 256 MiB over 2 layers of fp32 blocks of 16
SWEEP = (256, 512, 768, 1024, 1536, 2048)  # prompt lengths, around CAUSAL_ROWS
BUDGET = FrontEndArgs().max_num_batched_tokens  # tokens in a step: bench/engine.py's budget


def scattered(lengths: list[int], seed: int = 0):
    """A pool of POOL_BLOCKS blocks, the sequences' keys and values stored at shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // BLOCK) for n in lengths]
    order = (torch.randperm(POOL_BLOCKS - 1, generator=generator) + 1)[:sum(needed)]
    tables = torch.zeros(len(lengths), max(needed), dtype=torch.int64)
    for s, chunk in enumerate(order.split(needed)):
        tables[s, :len(chunk)] = chunk
    layer = torch.zeros(POOL_BLOCKS, 2, BLOCK, KV_HEADS * HEAD_DIM)
    total = sum(lengths)
    keys, values = (torch.randn(total, KV_HEADS, HEAD_DIM, generator=generator) for _ in "kv")
    positions = torch.cat([torch.arange(n) for n in lengths])
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    store_kv(keys, values, layer, tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK,
             backend="batched")
    return layer, tables


def attend_decodes(query, tokens, layer, blocks, mask, scale: float):
    """One decode group in plain tensor code, for torch.compile: rows of `tokens` against their
    blocks [S, num_blocks] through the table, masked by mask [S, 1, 1, positions]."""
    num_seqs, num_blocks = blocks.shape
    rows = query[tokens].view(num_seqs, KV_HEADS, -1, HEAD_DIM)
    keys, values = (layer[blocks, half].view(num_seqs, num_blocks * BLOCK, KV_HEADS, HEAD_DIM)
                    .transpose(1, 2) for half in (0, 1))
    scores = torch.matmul(rows, keys.transpose(2, 3)) * scale + mask
    return torch.matmul(scores.softmax(-1), values).view(num_seqs, -1, HEAD_DIM)


def timed(run, calls: int) -> list[float]:
    run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return times


def first_mixed_step() -> list[int]:
    """The prompt lengths of bench/engine.py's first step: whole prompts while they fit in the
    engine's token budget, then the first chunk of the next (nothing cached before any)."""
    from bench.engine import workload
    from minipaged.model import ModelConfig
    lengths, left = [], BUDGET
    for prompt in workload(ModelConfig.small(num_layers=2).vocab_size)[0]:
        lengths.append(min(len(prompt), left))
        left -= lengths[-1]
        if not left:
            break
    return lengths


def build_cpu_decode():
    """bench/cpu_decode.cpp, compiled into a fresh folder (so the build is timed every time)."""
    from torch.utils.cpp_extension import load
    return load("cpu_decode", [str(Path(__file__).with_name("cpu_decode.cpp"))],
                build_directory=tempfile.mkdtemp(prefix="cpu_decode_"),
                extra_cflags=["-O3", "-march=native", "-ffast-math"], verbose=False)


def after_the_prompts() -> None:
    """Run the engine's first step through the batched path once, untimed, as the engine runs
    its prompts' steps before its decodes: the large buffers that step allocates and frees move
    glibc's threshold for handing memory straight from the system (chapter 5.2), so the decodes
    after it recycle their buffers instead of faulting fresh pages in."""
    lengths = first_mixed_step()
    layer, tables = scattered(lengths)
    starts = torch.tensor([0] + lengths).cumsum(0)
    batched_paged_attention(torch.randn(sum(lengths), HEADS, HEAD_DIM), layer,
                            plan_batched_attention(tables, torch.tensor(lengths), starts, BLOCK))


def one_side(case: str, side: str, calls: int) -> dict:
    """Runs in a fresh process: the times of one side of one case."""
    generator = torch.Generator().manual_seed(1)
    if case == "decode":
        after_the_prompts()  # every side alike
        lengths = torch.randint(100, 371, (16,), generator=generator).tolist()
    elif case == FIRST_STEP:
        lengths = first_mixed_step()
    else:  # "prompts N": as many prompts of N tokens as fill one step's budget
        lengths = [int(case.split()[1])] * max(1, BUDGET // int(case.split()[1]))
    layer, tables = scattered(lengths)
    num_tokens = len(lengths) if case == "decode" else sum(lengths)  # one row a decode
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=generator)
    seq_lens = torch.tensor(lengths)
    starts = torch.arange(len(lengths) + 1) if case == "decode" else \
        torch.tensor([0] + lengths).cumsum(0)
    # the pieces: no prompt long enough to stay whole (the batched path as the engine's
    # prompts meet it); the decode case has no prompt
    plan = plan_batched_attention(tables, seq_lens, starts, BLOCK, causal_rows=max(lengths) + 1)
    scale, compile_s = HEAD_DIM ** -0.5, ""
    if side in ("batched", "pieces"):
        run = lambda: batched_paged_attention(query, layer, plan)
    elif side == "causal flag":  # every prompt whole: one call each, the flag, no mask
        whole = plan_batched_attention(tables, seq_lens, starts, BLOCK, causal_rows=2)
        run = lambda: batched_paged_attention(query, layer, whole)
    elif side == "compiled":
        # a fresh Inductor cache, so that the first call pays what a first run ever pays
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor_")
        attend = torch.compile(attend_decodes, dynamic=True)
        def run():
            out = torch.empty_like(query)
            for group in plan.groups:
                out.index_copy_(0, group.real_tokens, attend(
                    query, group.real_tokens, layer, group.blocks, group.mask, scale))
            return out
        start = time.perf_counter()
        run()
        compile_s = round(time.perf_counter() - start, 1)
    elif side == "in place, C++":
        start = time.perf_counter()
        extension = build_cpu_decode()
        compile_s = round(time.perf_counter() - start, 1)
        run = lambda: extension.paged_decode(query, layer, tables, seq_lens, scale)
    got = run().reshape(query.shape)
    want = batched_paged_attention(query, layer, plan)
    difference = float((got - want).abs().max())
    equal = bool(torch.allclose(got, want, atol=1e-5, rtol=1e-5))
    return dict(times=timed(run, calls), compile_s=compile_s, equal=equal,
                difference=difference, sequences=len(lengths), tokens=num_tokens,
                shortest=min(lengths), longest=max(lengths))


FIRST_STEP = "engine's first step"
CASES = {"decode": ["batched", "compiled", "in place, C++"],
         FIRST_STEP: ["pieces", "causal flag"],
         **{f"prompts {n}": ["pieces", "causal flag"] for n in SWEEP}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, no CSV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    add_machine_option(parser)
    parser.add_argument("--side", nargs=2, help=argparse.SUPPRESS)  # a child process's case
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.side:
        print(json.dumps(one_side(*args.side, args.calls)))
        return
    rounds = 1 if args.quick else args.rounds
    found = {(c, s): [] for c, sides in CASES.items() for s in sides}
    compile_s, equal, difference, sizes = {}, {}, {}, {}
    for round_ in range(rounds):
        for case, sides in CASES.items():
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                out = subprocess.run([sys.executable, "-m", "bench.cpu_attention", "--calls",
                                      str(args.calls), "--side", case, side],
                                     capture_output=True, text=True, env=dict(os.environ),
                                     check=True, cwd=Path(__file__).resolve().parents[1])
                result = json.loads(out.stdout.strip().splitlines()[-1])
                found[case, side] += result["times"]
                if result["compile_s"] != "":
                    compile_s.setdefault((case, side), []).append(result["compile_s"])
                equal[case, side] = result["equal"]
                difference[case, side] = result["difference"]
                sizes[case] = {k: result[k] for k in ("sequences", "tokens", "shortest",
                                                      "longest")}
                print(f"round {round_ + 1}: {case}, {side}: fastest "
                      f"{min(result['times']):.2f} ms", flush=True)
    rows = [dict(case=case, **sizes[case], side=side, threads=1, rounds=rounds,
                 calls=args.calls,
                 best_ms=round(min(times), 3), median_ms=round(statistics.median(times), 3),
                 compile_s=max(compile_s[case, side]) if (case, side) in compile_s else "",
                 equal_to_batched=equal[case, side],
                 max_abs_diff=(f"{difference[case, side]:.1e}"
                               if difference[case, side] != "" else ""),
                 machine=machine_note(args.machine))
            for (case, side), times in found.items()]
    for row in rows:
        print(row)
    if not args.quick:
        write_results("cpu_attention.csv", FIELDS, rows)


if __name__ == "__main__":
    main()
