"""Chapter 5's compile table: every launch the kernel wrappers make, compiled for a T4 and an A100.

No GPU is needed. The launches are recorded by calling the package's real wrappers
(``decode_attention``, ``extend_attention``, ``triton_store_kv``) with a recorder standing in
for each kernel, so what is compiled is what a wrapper would launch: its grid, its arguments
and its constants, ``num_warps`` and ``num_stages`` among them. Each launch goes to
``triton.compile`` as an ``ASTSource`` with the types, constants and alignment Triton's JIT
would give its arguments (public API only), and the ``cuobjdump`` that ships inside Triton reads
registers, spills and instructions from the machine code; programs per SM follow from each
architecture's SM limits.

Run with the interpreter off, since the compiler needs the kernels as ``JITFunction`` objects:

    TRITON_INTERPRET=0 python -m tools.compile_report           # print the table
    TRITON_INTERPRET=0 python -m tools.compile_report --write   # and commit it as a CSV
    TRITON_INTERPRET=0 python -m tools.compile_report --json    # the rows, for the tests

``--write`` leaves ``bench/results/compile_report.csv``, with the triton version that compiled
it in its own column; chapter 5 shows that file (a Colab reader has no repository to run this
from). ``tools/compile_check.py`` checks the table's claims; ``tests/test_kernels.py``
recompiles it and compares it with the committed file.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said aloud

import torch  # noqa: E402
import triton  # noqa: E402

from minipaged import kernels as K  # noqa: E402
from minipaged import quantized as Q  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CSV_PATH = ROOT / "bench" / "results" / "compile_report.csv"
COLUMNS = ("kernel", "GPU", "head dim", "tiles", "registers", "spill stack (B)", "shared (KiB)",
           "programs / SM", "instructions", "triton")
NUMBERS = {"head dim": int, "registers": int, "spill stack (B)": int, "shared (KiB)": float,
           "programs / SM": int, "instructions": int}
GPU_NAMES = {75: "T4 (7.5)", 80: "A100 (8.0)"}
GPU_SMS = {75: 40, 80: 108}


# ---- what one SM shares among its resident programs ----

@dataclass(frozen=True)
class SMLimits:
    """What one SM of an architecture shares among its resident programs."""

    registers: int
    shared_bytes: int  # shared memory for all resident programs together
    warps: int
    programs: int
    reserved_shared: int  # bytes the driver keeps for each program (1 KiB from 8.0)


SM_LIMITS = {75: SMLimits(65536, 64 * 1024, 32, 16, 0),  # CUDA guide, compute capabilities
             80: SMLimits(65536, 164 * 1024, 64, 32, 1024),
             86: SMLimits(65536, 100 * 1024, 48, 16, 1024),
             89: SMLimits(65536, 100 * 1024, 48, 24, 1024),
             90: SMLimits(65536, 228 * 1024, 64, 32, 1024)}


def programs_per_sm(capability: int, registers: int, shared_bytes: int, num_warps: int) -> int:
    """Programs one SM keeps resident: the least of what registers, shared memory, warps allow."""
    limits = SM_LIMITS[capability]
    per_warp = -(-registers * 32 // 256) * 256  # registers go to warps 256 at a time
    by_registers = limits.registers // per_warp // num_warps
    by_shared = limits.shared_bytes // max(1, shared_bytes + limits.reserved_shared)
    return min(by_registers, by_shared, limits.warps // num_warps, limits.programs)


# ---- the wrappers' launches, recorded ----

@dataclass
class Launch:
    """One kernel launch as a wrapper makes it: kernel, grid, arguments, constants."""

    kernel: object  # the @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    constants: dict  # constexpr arguments, plus num_warps and num_stages


class Recorder:
    """Stands in for a kernel: ``recorder[grid](*args, **constants)`` records, runs nothing."""

    def __init__(self, kernel, launches: list[Launch]) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.launches.append(Launch(self.kernel, tuple(grid), args, constants))
        return launch


KERNELS = ("_decode_kernel", "_merge_splits_kernel", "_extend_kernel", "_store_kv_kernel")


def recorded(wrapper, target: K.Target, *args, **kwargs) -> list[Launch]:
    """The launches wrapper(*args, **kwargs) makes, in order, as on a GPU of this target."""
    launches: list[Launch] = []
    with contextlib.ExitStack() as stack:
        for name in KERNELS:
            recorder = Recorder(getattr(K, name), launches)
            stack.enter_context(mock.patch.object(K, name, recorder))
        stack.enter_context(mock.patch.object(K, "device_target", lambda device: target))
        wrapper(*args, **kwargs)
    return launches


KERNELS_8BIT = ("_decode_kernel_8bit", "_merge_splits_kernel", "_extend_kernel_8bit")


def recorded_8bit(wrapper, target: K.Target, *args, **kwargs) -> list[Launch]:
    """recorded() for chapter 14's 8-bit kernels, which minipaged.quantized launches."""
    launches: list[Launch] = []
    with contextlib.ExitStack() as stack:
        for name in KERNELS_8BIT:
            stack.enter_context(mock.patch.object(Q, name, Recorder(getattr(Q, name), launches)))
        stack.enter_context(mock.patch.object(Q, "device_target", lambda device: target))
        wrapper(*args, **kwargs)
    return launches


def example_launches(target: K.Target, head_dim: int = 64) -> dict[str, Launch]:
    """The wrappers' launches for Qwen2.5-0.5B's heads (2 KV heads, groups of 7) in fp16."""
    seqs, context, block_size, width = 8, 2048, 16, 2 * head_dim
    cache = torch.empty(seqs * context // block_size, 2, block_size, width, dtype=torch.float16)
    tables = torch.arange(cache.shape[0], dtype=torch.int32).reshape(seqs, -1)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.empty(seqs, 14, head_dim, dtype=torch.float16)
    decode = lambda **options: recorded(K.decode_attention, target, query, cache, tables,
                                        seq_lens, max_seqlen_k=context, validate=False,
                                        **options)
    split, merge = decode()  # batch 8: split to fill the SMs
    launches = {"decode": split, "decode, one split": decode(num_splits=1)[0],
                "decode, per-tile lookup": decode(lookup="tile")[0], "merge of splits": merge}
    tokens = torch.empty(4 * 16, 14, head_dim, dtype=torch.float16)
    starts = torch.arange(0, 65, 16, dtype=torch.int32)
    launches["extend"], = recorded(K.extend_attention, target, tokens, cache, tables[:4],
                                   seq_lens[:4], starts, validate=False)
    key = torch.empty(64, 2, head_dim, dtype=torch.float16)
    launches["store"], = recorded(K.triton_store_kv, target, key, key, cache, torch.arange(64),
                                  validate=False)
    return launches


def example_launches_8bit(target: K.Target, head_dim: int = 64) -> dict[str, Launch]:
    """Chapter 14's decode and extend over each 8-bit format, at example_launches' shapes."""
    seqs, context, block_size, launches = 8, 2048, 16, {}
    for name, kv_format in Q.FORMATS.items():
        cache = torch.empty(seqs * context // block_size, 2, block_size,
                            2 * (head_dim + kv_format.scale_bytes), dtype=torch.uint8)
        tables = torch.arange(cache.shape[0], dtype=torch.int32).reshape(seqs, -1)
        seq_lens = torch.full((seqs,), context, dtype=torch.int32)
        query = torch.empty(seqs, 14, head_dim, dtype=torch.float16)
        launches[f"decode, {name}"] = recorded_8bit(
            Q.triton_quantized_attention, target, query, cache, tables, seq_lens,
            torch.arange(seqs + 1), kv_format)[0]  # its merge is chapter 5's, in the table
        tokens = torch.empty(4 * 16, 14, head_dim, dtype=torch.float16)
        launches[f"extend, {name}"], = recorded_8bit(
            Q.triton_quantized_attention, target, tokens, cache, tables[:4], seq_lens[:4],
            torch.arange(0, 65, 16), kv_format)
    return launches


# ---- compiled, as the JIT would compile them ----

def _tool(name: str, *args: str) -> str:
    """The output of one of the CUDA tools that ship inside Triton (cuobjdump)."""
    path = getattr(triton.knobs.nvidia, name).path
    return subprocess.run([path, *args], capture_output=True, text=True, check=True).stdout


POINTER_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
                 torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8"}


def _specialize(value) -> tuple[str, bool]:
    """The type Triton's JIT gives an argument, and whether it counts as divisible by 16."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    return "fp32", False  # a Python float


def launch_source(launch: Launch):
    """The launch as the compiler's input: argument types, constants, alignment (public API)."""
    from triton.compiler import ASTSource

    kernel = launch.kernel
    values = dict(zip((p.name for p in kernel.params), launch.args)) | launch.constants
    signature, constants, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):  # the JIT folds a 1 too
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        signature[param.name], aligned = _specialize(value)
        if aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constants, attrs)


def compile_launch(launch: Launch, capability: int) -> dict:
    """Compile a launch for a GPU of this capability, as the JIT would, and read its needs."""
    from triton.backends.compiler import GPUTarget

    options = {k: v for k, v in launch.constants.items() if k in ("num_warps", "num_stages")}
    compiled = triton.compile(launch_source(launch), target=GPUTarget("cuda", capability, 32),
                              options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = _tool("cuobjdump", "--dump-resource-usage", cubin.name)
        sass = _tool("cuobjdump", "--dump-sass", cubin.name)
    registers, stack = (int(re.search(rf"{key}:(\d+)", usage)[1]) for key in ("REG", "STACK"))
    shared, warps = compiled.metadata.shared, compiled.metadata.num_warps
    return {"registers": registers, "spill stack (B)": stack, "shared (KiB)": shared / 1024,
            "programs / SM": programs_per_sm(capability, registers, shared, warps),
            "instructions": len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))}


def table_launches(capability: int, head_dim: int, first_head_dim: int) -> dict[str, Launch]:
    """The launches of the table for one GPU and head size (beside the dispatcher's own, the T4
    at Ampere's tiles and at the other prefetch choice)."""
    looping = ("decode, one split", "extend")  # the kernels whose loop the tiles shape
    launches = example_launches(K.Target(capability, GPU_SMS[capability]), head_dim)
    if head_dim != first_head_dim:  # other head sizes: the looping kernels only
        return {name: launches[name] for name in looping}
    launches |= example_launches_8bit(K.Target(capability, GPU_SMS[capability]), head_dim)
    if capability >= 80:
        del launches["decode, per-tile lookup"]  # compared on the T4
        return launches
    ampere = example_launches(K.Target(80, GPU_SMS[capability]), head_dim)
    launches |= {f"{name}, Ampere's tiles": ampere[name] for name in looping}
    for name in ("decode", "decode, one split"):
        launch = launches[name]
        prefetch = not launch.constants["PREFETCH"]
        launches[f"{name}, prefetch {'on' if prefetch else 'off'}"] = Launch(
            launch.kernel, launch.grid, launch.args, launch.constants | {"PREFETCH": prefetch})
    return launches


def tiles(launch: Launch) -> str:
    """The sizes the dispatcher picked for a launch, as the table's "tiles" column shows them."""
    sizes = {k: v for k, v in launch.constants.items()
             if k in ("BLOCK_M", "TILE", "NUM_SPLITS", "PREFETCH")}
    return " ".join(f"{k}={v}" for k, v in sizes.items()) or "—"


def table_rows(capabilities=(75, 80), head_dims=(64, 128)):
    """(capability, head dim, name, launch) for each row of the table, in order: every launch
    for every capability, and the T4 alone at other head sizes, where registers are tight."""
    for capability, head_dim in ((c, d) for c in capabilities for d in head_dims):
        if capability >= 80 and head_dim != head_dims[0]:
            continue
        for name, launch in table_launches(capability, head_dim, head_dims[0]).items():
            yield capability, head_dim, name, launch


def compile_report(capabilities=(75, 80), head_dims=(64, 128)) -> list[dict]:
    """The table: each row's launch compiled for its GPU, and what the machine code needs."""
    if not isinstance(K._decode_kernel, triton.runtime.JITFunction):
        raise SystemExit("the kernels were made for Triton's interpreter: run this with "
                         "TRITON_INTERPRET=0")
    return [{"kernel": name, "GPU": GPU_NAMES[capability], "head dim": head_dim,
             "tiles": tiles(launch)} | compile_launch(launch, capability)
            | {"triton": triton.__version__}
            for capability, head_dim, name, launch in table_rows(capabilities, head_dims)]


def read_csv(path: Path = CSV_PATH) -> list[dict]:
    """The committed table, its numbers as numbers."""
    with open(path, newline="") as handle:
        return [{k: NUMBERS.get(k, str)(v) for k, v in row.items()}
                for row in csv.DictReader(handle)]


def write_csv(rows: list[dict], path: Path = CSV_PATH) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {CSV_PATH.relative_to(ROOT)}")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    args = parser.parse_args(argv)
    rows = compile_report()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(" | ".join(COLUMNS))
    for row in rows:
        print(" | ".join(str(row[c]) for c in COLUMNS))
    if args.write:
        write_csv(rows)
        print(f"wrote {CSV_PATH.relative_to(ROOT)} ({len(rows)} rows, triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
