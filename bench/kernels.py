"""Price the block table alone: the same decode kernel with and without it, on a GPU.

For one layer of Qwen2.5-0.5B's geometry (2 KV heads of 64, 7 query heads per KV head, fp16)
this times, with triton.testing.do_bench:

* the decode kernel over a contiguous cache [S, 2, max_len, Hkv * D] (no table);
* the same kernel over a paged cache with blocks scattered in the pool, reading the table once
  per position and once per block of a tile, for block sizes 8 to 64;
* torch's scaled_dot_product_attention on the same keys and values laid out contiguously, the
  peer a user would reach for;

at contexts 128 to 8,192 and batches 1 to 256. Each time becomes achieved bandwidth (bytes of
keys and values read divided by time) and a share of the GPU's peak. The CSV goes to
bench/results/kernels.csv and chapters/data/05/kernels.csv (the chapter plots it), the figure to
bench/results/kernels.png.

    python bench/kernels.py            # the full grid
    python bench/kernels.py --quick    # a few points, to check the script runs

Without CUDA it prints why it did nothing and exits with status 0.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Peak memory bandwidth in GB/s, from the vendors' data sheets; matched against the device name.
PEAK_GB_PER_S = {"H200": 4800, "H100": 3350, "A100 80GB": 2039, "A100": 1555, "T4": 320}
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 7, 64
CONTEXTS = (128, 256, 512, 1024, 2048, 4096, 8192)
BATCHES = (1, 4, 16, 32, 64, 128, 256)
BLOCK_SIZES = (8, 16, 32, 64)
FIELDS = ("gpu", "kernel", "block_size", "context", "batch", "ms", "kv_bytes", "gb_per_s",
          "peak_gb_per_s", "share_of_peak")


def peak_bandwidth(name: str, total_memory: int) -> float | None:
    """Peak GB/s of a known GPU by its name (an A100 with more than 40 GB is the 80 GB one)."""
    if "A100" in name and total_memory > 50 * 2**30:
        return PEAK_GB_PER_S["A100 80GB"]
    for key, peak in PEAK_GB_PER_S.items():
        if key in name and key != "A100 80GB":
            return peak
    return None


def scattered_tables(batch: int, context: int, block_size: int, device) -> torch.Tensor:
    """Block tables for batch sequences of context tokens over a shuffled pool."""
    per_seq = -(-context // block_size)
    order = torch.randperm(batch * per_seq, device=device, dtype=torch.int64)
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


def point_runs(batch: int, context: int, block_sizes, device) -> tuple[dict, int]:
    """The callables to time at one (context, batch) point, checked first; and the K/V bytes."""
    from minipaged.kernels import contiguous_decode_attention, decode_attention

    torch.manual_seed(0)
    width = NUM_KV_HEADS * HEAD_DIM
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float16,
                        device=device)
    contiguous = torch.randn(batch, 2, context, width, dtype=torch.float16, device=device)
    keys = contiguous[:, 0].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    values = contiguous[:, 1].view(batch, context, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    runs = {("contiguous", 0): lambda: contiguous_decode_attention(query, contiguous, seq_lens),
            ("torch sdpa", 0): lambda: sdpa(query.unsqueeze(2), keys, values, enable_gqa=True)}
    expected = runs["contiguous", 0]().float()
    for block_size in block_sizes:
        tables = scattered_tables(batch, context, block_size, device)
        cache = paged_copy(contiguous, tables, block_size)
        for lookup in ("position", "tile"):
            def run(cache=cache, tables=tables, lookup=lookup):
                return decode_attention(query, cache, tables, seq_lens, lookup=lookup)
            error = (run().float() - expected).abs().max().item()
            if error > 1e-2:
                raise AssertionError(f"paged ({lookup}, B={block_size}) differs from the "
                                     f"contiguous kernel by {error}")
            runs[f"paged per {lookup}", block_size] = run
    return runs, contiguous.numel() * contiguous.element_size()


def measure(gpu: str, peak: float | None, contexts, batches, block_sizes, device) -> list[dict]:
    """Time every kernel at every point of the grid; return one row per (kernel, point)."""
    from triton.testing import do_bench

    rows = []
    for context in contexts:
        for batch in batches:
            runs, kv_bytes = point_runs(batch, context, block_sizes, device)
            for (kernel, block_size), run in runs.items():
                ms = do_bench(run, warmup=10, rep=50)
                gb_per_s = kv_bytes / (ms * 1e-3) / 1e9
                rows.append({"gpu": gpu, "kernel": kernel, "block_size": block_size,
                             "context": context, "batch": batch, "ms": ms, "kv_bytes": kv_bytes,
                             "gb_per_s": gb_per_s, "peak_gb_per_s": peak or "",
                             "share_of_peak": gb_per_s / peak if peak else ""})
                print(f"{kernel:>18} B={block_size:<3} context={context:<5} batch={batch:<4} "
                      f"{ms * 1e3:9.1f} us {gb_per_s:8.1f} GB/s", flush=True)
            del runs
            torch.cuda.empty_cache()
    return rows


def write_csv(rows: list[dict], paths) -> None:
    """Write the rows to every path given."""
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path.relative_to(ROOT)}")


def plot(rows: list[dict], path: Path) -> None:
    """Achieved GB/s against context, one panel per batch, block size 16 for the paged runs."""
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.2 * len(batches), 3.2), sharey=True,
                             squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for kernel in ("contiguous", "paged per position", "paged per tile", "torch sdpa"):
            points = sorted((row["context"], row["gb_per_s"]) for row in rows
                            if row["batch"] == batch and row["kernel"] == kernel
                            and row["block_size"] in (0, 16))
            if points:
                ax.plot(*zip(*points), marker="o", label=kernel)
        if rows[0]["peak_gb_per_s"]:
            ax.axhline(rows[0]["peak_gb_per_s"], color="grey", linestyle="--", label="peak")
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("context (tokens)")
    axes[0][0].set_ylabel("K/V read (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Decode attention, one layer of Qwen2.5-0.5B, fp16, on {rows[0]['gpu']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path.relative_to(ROOT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device here, nothing measured. The kernels' timings "
              "need a GPU; run this script on one (a Colab T4 will do).")
        return 0
    sys.path.insert(0, str(ROOT))
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    gpu = torch.cuda.get_device_name(device)
    peak = peak_bandwidth(gpu, properties.total_memory)
    grid = ((1024,), (1, 32), (16,)) if args.quick else (CONTEXTS, BATCHES, BLOCK_SIZES)
    rows = measure(gpu, peak, *grid, device)
    paths = [ROOT / "bench/results/kernels.csv"]
    if not args.quick:  # only a full grid goes to the chapter
        paths.append(ROOT / "chapters/data/05/kernels.csv")
    write_csv(rows, paths)
    plot(rows, ROOT / "bench/results/kernels.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
