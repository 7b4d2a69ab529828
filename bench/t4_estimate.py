"""How long each chapter should take on a Colab T4 at full size: an estimate, until a GPU measures.

No GPU has run the chapters yet, so this script estimates, from things it can state:

* **Work.** tools/t4_ledger.py walks each chapter at full size and counts the model's forward
  passes (steps) and the prompt tokens it computes: ``llm.generate`` and ``llm.stream`` as
  prompt tokens in steps of ``max_num_batched_tokens``, then one step per generated token for
  each batch of ``max_num_seqs`` requests; a model or a transformers peer called directly, one
  step per call or per new token. Where a pool is too small for every request at once, the steps
  are those of the book's own scheduler run over the requests' lengths, so preemption's extra
  steps and the tokens it recomputes are counted (their own columns say how many). Requests whose
  length the ledger cannot follow are not (the ``uncounted`` column).
* **The card's floor.** Each step streams the weights once at the T4's 320 GB/s, and each prompt
  token, and each token a preemption recomputes, costs 2 x parameters FLOPs at its 65 TFLOP/s in
  fp16: the fastest the work could go.
* **The host's cost.** Chapter 13's host model, ``minipaged.serving.HostCost`` (one owner):
  each step launches about ten kernels per layer of Qwen2.5-0.5B's 24 at a stated cost each,
  and each running request costs a stated time per step (here: per generated token). Its
  constants are stated there, and chapter 13 checks the whole clock against the study's runs.
* **Chapters without GPU work** (the simulations of chapters 2 and 3) are timed here, on this
  CPU, at full size (``--run-cpu-chapters``; MINIPAGED_SCALE=full), as Colab's CPU would run them.

Not included, and said so in each chapter's ``not counted`` note: installing minipaged,
downloading the checkpoint, Triton's first compilation of each kernel variant a chapter launches
(chapter 5 alone compiles some thirty; no GPU has timed a compilation yet), and chapter 5's
kernel timings (bench/gpu_check measures those on a GPU).
Writes bench/results/t4_estimate.csv (the numbers) and t4_estimate_notes.csv (how each chapter
was estimated, and what it leaves out); book/colab.md shows both.

    python bench/t4_estimate.py                     # CPU chapters' times kept from the last CSV
    python bench/t4_estimate.py --run-cpu-chapters  # time chapters 2 and 3 at full size again
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import sys
import time
from pathlib import Path

from minipaged.memory import QWEN2_5_0_5B
from minipaged.serving import T4_BYTES_PER_S, T4_FP16_FLOPS, HostCost  # one definition each

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "t4_estimate.csv"
NOTES_CSV = RESULTS.with_name("t4_estimate_notes.csv")
CPU_CHAPTERS = ("02_fragmentation", "03_block_pool")
FIELDS = ["chapter", "peak GiB on a T4 (ledger)", "steps", "of which preemption",
          "prompt tokens", "recomputed tokens", "uncounted requests", "floor min", "host min",
          "estimate min"]  # floor + host = estimate, each rounded
NOTE_FIELDS = ["chapter", "how", "not counted"]  # a table of their own: a page holds it whole
GPU_SETUP = "install, checkpoint download, Triton compilation"  # what no row counts
# What a row leaves out besides: chapters that never launch a kernel compile nothing.
NOT_COUNTED = {"01_kv_memory": "install, checkpoint download (transformers runs no Triton kernel)",
               "02_fragmentation": "install", "03_block_pool": "install",
               "05_paged_attention": f"{GPU_SETUP} (about 30 kernel variants), kernel timings",
               "05_what_the_table_costs": "install (it launches no kernel)"}
# What the ledger's count leaves out, where it is most of a chapter's time.
NOTES = {"05_paged_attention": "kernel timings not counted: bench/gpu_check measures them"}


def load_ledger():
    spec = importlib.util.spec_from_file_location("t4_ledger", ROOT / "tools" / "t4_ledger.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["t4_ledger"] = module
    spec.loader.exec_module(module)
    return module


def cpu_chapter_seconds(chapter: str) -> float:
    """Execute a chapter at full size on this CPU (nbclient, as the book's build does); seconds."""
    import nbformat
    from nbclient import NotebookClient

    os.environ.update(MINIPAGED_SCALE="full", MINIPAGED_DEVICE="cpu", TRITON_INTERPRET="1")
    notebook = nbformat.read(ROOT / "chapters" / f"{chapter}.ipynb", as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=3600, resources={"metadata": {"path": str(ROOT / "chapters")}}
                   ).execute()
    return time.perf_counter() - start


def previous_rows() -> dict[str, dict]:
    if not RESULTS.exists():
        return {}
    with open(RESULTS, newline="", encoding="utf-8") as handle:
        return {row["chapter"]: row for row in csv.DictReader(handle)}


def previous_minutes(rows: dict[str, dict], chapter: str) -> float:
    """The estimate the last CSV gave a chapter, in minutes (NaN when there is none)."""
    try:
        return float(rows[chapter]["estimate min"])
    except (KeyError, ValueError):
        return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-cpu-chapters", action="store_true")
    args = parser.parse_args()
    ledger, before = load_ledger(), previous_rows()
    host = HostCost(QWEN2_5_0_5B.num_layers)  # chapter 13's host model
    rows = []
    for notebook in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        result = ledger.ledger(notebook)
        work, chapter = result.work, notebook.stem
        parameters = work.weight_bytes / 2  # fp16
        floor = (work.steps * work.weight_bytes / T4_BYTES_PER_S
                 + 2 * parameters * (work.prompt_tokens + work.recomputed_tokens) / T4_FP16_FLOPS)
        host_seconds = (work.steps * host.launches_seconds
                        + work.generated_tokens * host.per_request_seconds)
        estimate = floor + host_seconds
        how = "floor + host model (launches per step, work per generated token)"
        if chapter in CPU_CHAPTERS:
            seconds = (cpu_chapter_seconds(chapter) if args.run_cpu_chapters
                       else previous_minutes(before, chapter) * 60)
            floor, host_seconds, estimate = float("nan"), float("nan"), seconds
            how = "measured at full size on this CPU"
        elif not work.steps:
            how = "no model steps counted"
        how = NOTES.get(chapter, how)
        peak = result.peak.total / 2**30 if result.peak else 0.0
        minutes = lambda seconds: "—" if seconds != seconds else f"{seconds / 60:.2f}"  # NaN: —
        left_out = NOT_COUNTED.get(chapter, GPU_SETUP) + (
            f", {work.unknown_requests} requests the ledger cannot follow"
            if work.unknown_requests else "")
        rows.append({"chapter": chapter, "peak GiB on a T4 (ledger)": f"{peak:.2f}",
                     "steps": f"{work.steps:,}",
                     "of which preemption": f"{work.preemption_steps:,}",
                     "prompt tokens": f"{work.prompt_tokens:,}",
                     "recomputed tokens": f"{work.recomputed_tokens:,}",
                     "uncounted requests": f"{work.unknown_requests:,}",
                     "floor min": minutes(floor), "host min": minutes(host_seconds),
                     "estimate min": f"{estimate / 60:.1f}" if estimate >= 6 else "< 0.1",
                     "how": how, "not counted": left_out})
        print(rows[-1])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    for path, fields in ((RESULTS, FIELDS), (NOTES_CSV, NOTE_FIELDS)):
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
