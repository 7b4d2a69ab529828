"""Price the block table alone: the same kernels with and without it, on a GPU.

For one layer of Qwen2.5-0.5B's geometry (2 KV heads of 64, 7 query heads per KV head, fp16)
this times, with triton.testing.do_bench:

* decode: the kernel over a contiguous cache [S, 2, max_len, Hkv * D] (no table), and the same
  kernel over a paged cache with blocks scattered in the pool, reading the table once per
  position and once per tile, at block sizes 1 to 64; torch's scaled_dot_product_attention on
  the contiguous keys and values beside them;
* extend (a chunk of many query tokens, causal, over a paged context): the kernel with blocks
  scattered, the same kernel with each sequence's blocks in order (its contiguous twin), and
  torch's scaled_dot_product_attention with the causal mask;
* a device-to-device copy, whose bytes read and written per second are the bandwidth this card
  really delivers: every kernel's GB/s is also given as a share of it (and of the datasheet).

Every paged result is checked against its twin first; the largest difference is a column.
Rows are written as they are measured to bench/results/<gpu-name>/kernels.csv (the folder
chapter 5 reads, through ``minipaged.runtime.gpu_results("kernels")``).

    python -m bench.kernel_speed            # the full grid (about a minute on an H200)
    python -m bench.kernel_speed --quick    # a few points, to check the script runs

Without CUDA it prints why it did nothing and exits with status 0; ``bench/gpu_check --dry-run``
runs the same code on a CPU, under Triton's interpreter, at tiny sizes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.gpu_check.common import RowWriter, environment, results_folder, write_json

ROOT = Path(__file__).resolve().parent.parent

# Peak memory bandwidth in GB/s, from the vendors' data sheets; matched against the device name.
PEAK_GB_PER_S = {"H200": 4800, "H100": 3350, "A100 80GB": 2039, "A100": 1555, "T4": 320}
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 7, 64
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
TOLERANCE = 1e-2  # fp16 outputs of two kernels over the same keys and values


@dataclass(frozen=True)
class Grid:
    """The points to measure: decode contexts x batches, extend (context, query, batch)."""

    decode_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    block_sizes: tuple[int, ...]
    extend_points: tuple[tuple[int, int, int], ...]
    extend_block_sizes: tuple[int, ...]
    copy_bytes: int


GRIDS = {
    "full": Grid((128, 512, 2048, 8192), (1, 32, 256), BLOCK_SIZES,
                 ((2048, 512, 1), (2048, 512, 16)), BLOCK_SIZES, 2**30),
    "quick": Grid((1024,), (1, 32), (1, 16, 64), ((1024, 256, 4),), (16,), 2**28),
    "dry": Grid((40,), (2,), (1, 16), ((40, 8, 2),), (16,), 2**20),
}
FIELDS = ["gpu", "phase", "kernel", "block_size", "context", "query_len", "batch", "ms",
          "kv_bytes", "gb_per_s", "tflops", "copy_gb_per_s", "share_of_copy", "peak_gb_per_s",
          "share_of_peak", "max_abs_error"]


def peak_bandwidth(name: str, total_memory: int) -> float | None:
    """Datasheet GB/s of a known GPU by its name (an A100 with more than 40 GB is the 80 GB one)."""
    if "A100" in name and total_memory > 50 * 2**30:
        return PEAK_GB_PER_S["A100 80GB"]
    for key, peak in PEAK_GB_PER_S.items():
        if key in name and key != "A100 80GB":
            return peak
    return None


def time_ms(run, device: torch.device) -> float:
    """Milliseconds per call: triton's do_bench on a GPU, the median of a few calls elsewhere."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(run, warmup=10, rep=40)
    run()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), device)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def scattered_tables(batch: int, context: int, block_size: int, device, shuffle=True):
    """Block tables for batch sequences of context tokens over a pool, shuffled or in order."""
    per_seq = -(-context // block_size)
    count = batch * per_seq
    order = torch.randperm(count, device=device) if shuffle else torch.arange(count, device=device)
    return order.view(batch, per_seq).to(torch.int32)


def paged_copy(contiguous: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """The contiguous keys and values [S, 2, L, W] rewritten into blocks at the tables' ids."""
    batch, _, context, width = contiguous.shape
    per_seq = tables.shape[1]
    padded = torch.zeros(batch, 2, per_seq * block_size, width, dtype=contiguous.dtype,
                         device=contiguous.device)
    padded[:, :, :context] = contiguous
    blocks = padded.view(batch, 2, per_seq, block_size, width).permute(0, 2, 1, 3, 4)
    cache = torch.empty(batch * per_seq, 2, block_size, width, dtype=contiguous.dtype,
                        device=contiguous.device)
    cache[tables.reshape(-1).long()] = blocks.reshape(-1, 2, block_size, width)
    return cache


def _heads(contiguous: torch.Tensor, batch: int, context: int):
    """Keys and values [S, Hkv, L, D] from the contiguous layout, for torch's sdpa."""
    keys = contiguous[:, 0].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    values = contiguous[:, 1].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    return keys, values


def decode_runs(batch: int, context: int, block_sizes, device, dtype):
    """{(kernel, block size): callable} at one decode point, each with its error; K/V bytes."""
    from minipaged.kernels import contiguous_decode_attention, decode_attention

    torch.manual_seed(0)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=dtype, device=device)
    contiguous = torch.randn(batch, 2, context, NUM_KV_HEADS * HEAD_DIM, dtype=dtype,
                             device=device)
    keys, values = _heads(contiguous, batch, context)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # validate=False and the longest length given: a timed call does no host check or sync,
    # as in the engine, where the step's metadata is checked once on the host.
    fast = dict(validate=False, max_seqlen_k=context)
    runs = {("contiguous", 0): lambda: contiguous_decode_attention(query, contiguous, seq_lens,
                                                                   **fast),
            ("torch sdpa", 0): lambda: sdpa(query.unsqueeze(2), keys, values,
                                            enable_gqa=True).squeeze(2)}
    expected = runs["contiguous", 0]().float()
    for block_size in block_sizes:
        tables = scattered_tables(batch, context, block_size, device)
        cache = paged_copy(contiguous, tables, block_size)
        for lookup in ("position", "tile"):
            def run(cache=cache, tables=tables, lookup=lookup):
                return decode_attention(query, cache, tables, seq_lens, lookup=lookup, **fast)
            runs[f"paged per {lookup}", block_size] = run
    errors = {key: (run().float() - expected).abs().max().item() for key, run in runs.items()}
    return runs, errors, contiguous.numel() * contiguous.element_size()


def extend_runs(batch: int, context: int, query_len: int, block_sizes, device, dtype):
    """The extend kernel over scattered and in-order blocks, and sdpa, at one point."""
    from minipaged.kernels import extend_attention

    torch.manual_seed(0)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * query_len
    query = torch.randn(batch * query_len, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=dtype,
                        device=device)
    contiguous = torch.randn(batch, 2, context, NUM_KV_HEADS * HEAD_DIM, dtype=dtype,
                             device=device)
    keys, values = _heads(contiguous, batch, context)
    q = query.view(batch, query_len, NUM_KV_HEADS * GROUP, HEAD_DIM).transpose(1, 2)
    positions = torch.arange(context, device=device)
    mask = positions[None, :] <= positions[context - query_len:, None]  # [query_len, context]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runs = {("extend torch sdpa", 0): lambda: sdpa(q, keys, values, attn_mask=mask,
                                                   enable_gqa=True).transpose(1, 2)
            .reshape(query.shape)}
    for block_size in block_sizes:
        for name, shuffle in (("extend paged", True), ("extend paged, blocks in order", False)):
            tables = scattered_tables(batch, context, block_size, device, shuffle)
            cache = paged_copy(contiguous, tables, block_size)
            def run(cache=cache, tables=tables):
                return extend_attention(query, cache, tables, seq_lens, starts, validate=False)
            runs[name, block_size] = run
    expected = runs["extend torch sdpa", 0]().float()
    errors = {key: (run().float() - expected).abs().max().item() for key, run in runs.items()}
    attended = query_len * (context - query_len) + query_len * (query_len + 1) / 2
    flops = 4 * NUM_KV_HEADS * GROUP * HEAD_DIM * attended * batch
    return runs, errors, contiguous.numel() * contiguous.element_size(), flops


def measure(grid: Grid, writer: RowWriter, device: torch.device, gpu: str,
            peak: float | None, log=print) -> int:
    """Time every kernel at every point of the grid, one CSV row each; return the row count."""
    dtype = torch.float16
    copy = copy_bandwidth(grid.copy_bytes, device)
    log(f"device-to-device copy: {copy:,.1f} GB/s (read + write)"
        + (f", datasheet {peak:,} GB/s" if peak else ""))
    base = {"gpu": gpu, "copy_gb_per_s": copy, "peak_gb_per_s": peak or ""}
    writer.write(base | {"phase": "copy", "kernel": "torch copy_", "block_size": 0,
                         "kv_bytes": grid.copy_bytes, "gb_per_s": copy, "share_of_copy": 1.0,
                         "share_of_peak": copy / peak if peak else ""})
    points = [("decode", c, 1, b) for c in grid.decode_contexts for b in grid.decode_batches]
    points += [("extend", c, q, b) for c, q, b in grid.extend_points]
    count = 1
    for phase, context, query_len, batch in points:
        flops = 0.0
        if phase == "decode":
            runs, errors, kv_bytes = decode_runs(batch, context, grid.block_sizes, device, dtype)
        else:
            runs, errors, kv_bytes, flops = extend_runs(batch, context, query_len,
                                                        grid.extend_block_sizes, device, dtype)
        for (kernel, block_size), run in runs.items():
            ms = time_ms(run, device)
            gb_per_s = kv_bytes / (ms * 1e-3) / 1e9
            writer.write(base | {
                "phase": phase, "kernel": kernel, "block_size": block_size, "context": context,
                "query_len": query_len, "batch": batch, "ms": ms, "kv_bytes": kv_bytes,
                "gb_per_s": gb_per_s, "tflops": flops / (ms * 1e-3) / 1e12,
                "share_of_copy": gb_per_s / copy, "share_of_peak": gb_per_s / peak if peak else "",
                "max_abs_error": errors[kernel, block_size]})
            count += 1
            flag = "" if errors[kernel, block_size] <= TOLERANCE else "  DIFFERS"
            log(f"{phase:>6} {kernel:>30} B={block_size:<3} context={context:<5} "
                f"batch={batch:<4} {ms * 1e3:9.1f} us {gb_per_s:8.1f} GB/s{flag}")
        del runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--results", type=Path, help="folder for kernels.csv (default: "
                        "bench/results/<gpu-name>/)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_speed.py: no CUDA device here, nothing measured. The kernels' timings "
              "need a GPU; run this script on one (a Colab T4 will do), or run "
              "`make gpu-check-dry` to check the code on a CPU.")
        return 0
    device = torch.device("cuda")
    info = environment(dry_run=False)
    folder = args.results or results_folder(info)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "env.json", info)
    (folder / "kernels.csv").unlink(missing_ok=True)  # a rerun replaces, never appends
    peak = peak_bandwidth(info["gpu"], info["total_memory_bytes"])
    with RowWriter(folder / "kernels.csv", FIELDS) as writer:
        measure(GRIDS["quick" if args.quick else "full"], writer, device, info["gpu"], peak)
    print(f"wrote {folder / 'kernels.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
