"""The block table's price on the CPU path: chapter 5's batched attention against a no-table twin.

Both sides run one layer of the book's small model geometry (14 query heads, 2 KV heads of 64,
fp32) over the same step, planned once by ``plan_batched_attention``: the same groups, the same
padding, the same masks and the same ``scaled_dot_product_attention`` calls. The only difference
is where the keys and values come from:

* **paged** (``batched_paged_attention``, what the engine runs on a CPU): every layer gathers each
  group's blocks through the block table into a padded batch, then attends;
* **contiguous** (no table): the same padded batches already sit in memory, one contiguous
  tensor per group, as if each sequence's keys and values had been stored in a row of their own
  (a reservation); the layer only attends.

So the difference is the table's price on this path: the gathers. A third side splits that price
in two:

* **paged, kept buffers**: the same gathers through the same table, written with
  ``index_select(..., out=)`` into buffers allocated once, before the timing, then the same
  attention. So "kept" minus "contiguous" is the price of copying through the table, and "paged"
  minus "kept" the price of the gathers' fresh output buffers.

Fresh buffers cost what the memory allocator makes them cost. glibc's ``malloc`` maps a large
block (above its threshold, 128 KiB to start with) straight from the operating system and unmaps
it when it is freed, so every first write to each of its pages is a page fault; after it has
freed a mapped block it raises the threshold to that block's size, and blocks below the new
threshold are then recycled from its heap. So the same gather costs more early in a process than
after larger blocks have come and gone. The script measures three steps, in this order, each
thread count in a fresh process of its own: a *decode step* (bench/engine.py's 32 sequences, each
one token past its prompt and half its answer), a *mixed step* (half of them decoding, half
bringing a 32-token chunk on top of their prompt), and the same decode step again, *after the
mixed step* has allocated and freed its larger buffers. In the engine the prompts' steps come
first, so its decode steps meet the allocator in that later state.

Each side runs once to warm up, then ``--repeats`` times, the sides taking turns and the order
reversed every other round; fastest and median are kept. Timings are reported, never asserted;
the outputs are checked equal.

    python -m bench.table_price          # writes bench/results/table_price_cpu.csv
    python -m bench.table_price --quick  # 3 repeats at 1 thread, no CSV
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.engine import (  # bench/engine.py's machine note, prompts, answers and CSVs
    add_machine_option,
    machine_note,
    workload,
    write_results,
)
from minipaged.kernels import _gather_group, batched_paged_attention, plan_batched_attention

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = ["threads", "step", "sequences", "query_tokens", "context_tokens", "repeats",
          "paged_ms_best", "contiguous_ms_best", "paged_ms_median", "contiguous_ms_median",
          "price_best", "price_median", "kept_ms_best", "kept_ms_median", "copy_price_median",
          "machine"]
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 14, 2, 64, 16


def step(kind: str, seed: int = 0):
    """Query, one cache layer with scattered blocks, tables, lengths and starts of one step."""
    prompts, answers = workload(512)
    contexts = [len(p) + a // 2 for p, a in zip(prompts, answers)]
    queries = [1] * len(contexts) if kind == "decode" else [
        1 if i % 2 else 32 for i in range(len(contexts))]
    gen = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // BLOCK_SIZE) for n in contexts]
    order = torch.randperm(sum(blocks_each) + 8, generator=gen).tolist()  # scattered blocks
    tables, at = [], 0
    for n in blocks_each:
        tables.append(order[at:at + n])
        at += n
    width = max(blocks_each)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    layer = torch.randn(len(order), 2, BLOCK_SIZE, KV_HEADS * HEAD_DIM, generator=gen)
    query = torch.randn(sum(queries), HEADS, HEAD_DIM, generator=gen)
    starts = torch.tensor([0] + queries).cumsum(0)
    return query, layer, block_tables, torch.tensor(contexts), starts, sum(contexts)


def contiguous_attention(query, stored, plan, scale=None) -> torch.Tensor:
    """batched_paged_attention's arithmetic on keys and values already laid out per group."""
    head_dim = query.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    output = torch.empty_like(query)
    for group, (keys, values) in zip(plan.groups, stored):
        rows = query[group.tokens].float()
        num_seqs, longest = group.tokens.shape
        if longest == 1:
            rows = rows.view(num_seqs, keys.shape[1], -1, head_dim)
            out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=group.mask,
                                                 scale=scale).view(num_seqs, 1, -1, head_dim)
        else:
            out = F.scaled_dot_product_attention(rows.transpose(1, 2), keys, values,
                                                 attn_mask=group.mask, scale=scale,
                                                 enable_gqa=True).transpose(1, 2)
        out = out.reshape(-1, *out.shape[2:])
        if len(group.real_rows) < len(out):
            out = out.index_select(0, group.real_rows)
        output.index_copy_(0, group.real_tokens, out.to(query.dtype))
    return output


def gather_into(layer, plan, buffers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """_gather_group's keys and values, written into buffers kept from call to call."""
    gathered = []
    for group, halves in zip(plan.groups, buffers):
        ids, (num_seqs, num_blocks) = group.blocks.reshape(-1), group.blocks.shape
        for half, buffer in enumerate(halves):
            torch.index_select(layer[:, half], 0, ids, out=buffer)
        gathered.append(tuple(b.view(num_seqs, num_blocks * BLOCK_SIZE, -1, HEAD_DIM)
                              .transpose(1, 2) for b in halves))
    return gathered


def measure(threads: int, repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for step_name, kind in (("decode", "decode"), ("mixed", "mixed"),
                            ("decode, after the mixed step", "decode")):
        query, layer, tables, lens, starts, context = step(kind)
        plan = plan_batched_attention(tables, lens, starts, BLOCK_SIZE)
        stored = [tuple(t.clone() for t in _gather_group(layer, g.blocks, HEAD_DIM))
                  for g in plan.groups]  # the twin's cache: the gather's layout, kept
        buffers = [tuple(torch.empty(g.blocks.numel(), BLOCK_SIZE, layer.shape[3])
                         for _ in range(2)) for g in plan.groups]
        sides = {"paged": lambda q=query, c=layer, p=plan: batched_paged_attention(q, c, p),
                 "kept": lambda q=query, c=layer, p=plan, b=buffers:
                     contiguous_attention(q, gather_into(c, p, b), p),
                 "contiguous": lambda q=query, s=stored, p=plan: contiguous_attention(q, s, p)}
        assert torch.allclose(sides["paged"](), sides["contiguous"](), atol=1e-5)
        assert torch.allclose(sides["kept"](), sides["contiguous"](), atol=1e-5)
        times = {name: [] for name in sides}
        for round_ in range(repeats):
            for name in (list(sides) if round_ % 2 == 0 else list(sides)[::-1]):
                start = time.perf_counter()
                for _ in range(5):  # five layers' worth per timing, to rise above the clock
                    sides[name]()
                times[name].append((time.perf_counter() - start) / 5 * 1e3)
        best = {n: min(t) for n, t in times.items()}
        median = {n: statistics.median(t) for n, t in times.items()}
        rows.append(dict(threads=threads, step=step_name, sequences=len(lens),
                         query_tokens=query.shape[0], context_tokens=context, repeats=repeats,
                         paged_ms_best=round(best["paged"], 4),
                         contiguous_ms_best=round(best["contiguous"], 4),
                         paged_ms_median=round(median["paged"], 4),
                         contiguous_ms_median=round(median["contiguous"], 4),
                         price_best=round(best["paged"] / best["contiguous"] - 1, 4),
                         price_median=round(median["paged"] / median["contiguous"] - 1, 4),
                         kept_ms_best=round(best["kept"], 4),
                         kept_ms_median=round(median["kept"], 4),
                         copy_price_median=round(median["kept"] / median["contiguous"] - 1, 4)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, 1 thread, no CSV")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_machine_option(parser)
    parser.add_argument("--one-process", action="store_true",
                        help="measure the first thread count here and print the rows as JSON")
    args = parser.parse_args()
    repeats, threads = (3, [1]) if args.quick else (args.repeats, args.threads)
    if args.one_process:
        print(json.dumps(measure(threads[0], repeats)))
        return
    rows = []
    for n in threads:  # each thread count in a fresh process: the allocator starts anew
        run = subprocess.run([sys.executable, "-m", "bench.table_price", "--one-process",
                              "--threads", str(n), "--repeats", str(repeats)],
                             capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        rows += [dict(row, machine=machine_note(args.machine))
                 for row in json.loads(run.stdout.strip().splitlines()[-1])]
    for row in rows:
        print(f"{row['threads']} thr {row['step']:28} {row['sequences']} seqs, "
              f"{row['query_tokens']} query tokens: paged {row['paged_ms_best']:.3f} ms, "
              f"kept buffers {row['kept_ms_best']:.3f} ms, contiguous "
              f"{row['contiguous_ms_best']:.3f} ms (fastest; table "
              f"{100 * row['price_best']:+.0f}%, medians {100 * row['price_median']:+.0f}%, "
              f"of which copying {100 * row['copy_price_median']:+.0f}%)")
    if not args.quick:
        write_results("table_price_cpu.csv", FIELDS, rows)


if __name__ == "__main__":
    main()
