"""The Triton kernels against chapter 4's plain-torch reference, under Triton's interpreter."""
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minipaged import kernels as K
from minipaged.kernels import (
    check_block_size,
    contiguous_decode_attention,
    decode_attention,
    extend_attention,
    paged_attention,
    store_kv,
    triton_store_kv,
)
from minipaged.kv_cache import KVCache, reference_paged_attention, reference_store_kv

TOLERANCE = {torch.float16: 3e-3, torch.float32: 2e-5}


def make_batch(context_lengths, query_lengths, block_size, num_kv_heads=2, group=7,
               head_dim=64, dtype=torch.float16, seed=0, table_dtype=torch.int32):
    """A paged cache with each sequence's blocks scattered over the pool, tables, query."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context_lengths]
    num_blocks = sum(per_seq) + 5
    layer = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype).layers[0]
    layer.copy_(torch.randn(layer.shape, generator=gen))  # unowned blocks hold noise
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lengths), max(per_seq) + 2), 10**6, dtype=table_dtype)
    contiguous = torch.zeros(len(context_lengths), 2, max(context_lengths),
                             num_kv_heads * head_dim, dtype=dtype)
    used = 0
    for s, n in enumerate(context_lengths):
        tables[s, :per_seq[s]] = order[used:used + per_seq[s]].to(table_dtype)
        used += per_seq[s]
        key, value = torch.randn(2, n, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = tables[s, torch.arange(n) // block_size].long() * block_size
        reference_store_kv(key, value, layer, slots + torch.arange(n) % block_size)
        contiguous[s, 0, :n], contiguous[s, 1, :n] = key.flatten(1), value.flatten(1)
    starts = torch.tensor([0] + list(query_lengths)).cumsum(0)
    query = torch.randn(int(starts[-1]), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, layer, tables, torch.tensor(context_lengths), starts, contiguous


def assert_close(actual, expected, dtype):
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE[dtype], error


# ---- quick checks (no kernel launch) ----

@pytest.mark.parametrize("block_size", [2**i for i in range(K.MAX_BLOCK_SIZE.bit_length())])
def test_check_block_size_accepts_powers_of_two(block_size):
    assert check_block_size(block_size) == block_size


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 24, 2 * K.MAX_BLOCK_SIZE, 16.0, True])
def test_check_block_size_names_the_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        check_block_size(block_size)


def test_unknown_backend_and_lookup_are_refused():
    query, layer, tables, seq_lens, starts, _ = make_batch([5], [1], 4)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(query, layer, tables, seq_lens, starts, backend="cuda")
    with pytest.raises(ValueError, match="lookup"):
        decode_attention(query, layer, tables, seq_lens, lookup="block")


def test_store_refuses_a_slot_outside_the_pool():
    layer = KVCache(1, 4, 4, 2, 64, dtype=torch.float16).layers[0]
    key = torch.zeros(2, 2, 64, dtype=torch.float16)
    for bad in ([0, 16], [-2, 0]):
        with pytest.raises(ValueError, match="slot_mapping"):
            triton_store_kv(key, key, layer, torch.tensor(bad))


def test_bad_head_dim_is_refused():
    query, layer, tables, seq_lens, _, _ = make_batch([5], [1], 4)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(query[..., :48], layer[..., :96], tables, seq_lens)


# ---- kernels under the interpreter (heavy) ----

@pytest.mark.heavy
@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("lookup", ["position", "tile"])
def test_decode_matches_reference_at_every_block_size(block_size, lookup):
    lengths = [1, 17, 64, 301]
    query, layer, tables, seq_lens, starts, _ = make_batch(lengths, [1] * 4, block_size)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(decode_attention(query, layer, tables, seq_lens, lookup=lookup), expected,
                 torch.float16)


@pytest.mark.heavy
@pytest.mark.parametrize("group, head_dim", [(1, 128), (2, 64), (7, 128)])
def test_decode_gqa_ratios_and_head_dims(group, head_dim):
    query, layer, tables, seq_lens, starts, contiguous = make_batch(
        [3, 90, 200], [1] * 3, 8, group=group, head_dim=head_dim, table_dtype=torch.int64)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(decode_attention(query, layer, tables, seq_lens, lookup="tile", tile_size=16),
                 expected, torch.float16)
    assert_close(contiguous_decode_attention(query, contiguous, seq_lens), expected,
                 torch.float16)


@pytest.mark.heavy
@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_decode_splits_merge_to_the_same_answer(num_splits):
    # Lengths shorter than the number of splits leave some splits empty.
    query, layer, tables, seq_lens, starts, _ = make_batch([1, 5, 250], [1] * 3, 16,
                                                           dtype=torch.float32)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    out = decode_attention(query, layer, tables, seq_lens, tile_size=16, num_splits=num_splits)
    assert_close(out, expected, torch.float32)


@pytest.mark.heavy
@pytest.mark.parametrize("block_size, group, head_dim", [(1, 7, 64), (4, 2, 128), (16, 7, 64),
                                                         (64, 1, 64)])
def test_extend_matches_reference_on_a_mixed_batch(block_size, group, head_dim):
    # Full prefill, a chunk on top of a cached context, a prefix hit's last tokens, a decode.
    query, layer, tables, seq_lens, starts, _ = make_batch(
        [40, 123, 67, 90], [40, 23, 3, 1], block_size, group=group, head_dim=head_dim)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(extend_attention(query, layer, tables, seq_lens, starts), expected,
                 torch.float16)
    assert_close(paged_attention(query, layer, tables, seq_lens, starts, backend="triton"),
                 expected, torch.float16)


@pytest.mark.heavy
def test_triton_backend_takes_the_decode_path_for_one_token_each():
    query, layer, tables, seq_lens, starts, _ = make_batch([7, 33], [1, 1], 2,
                                                           dtype=torch.float32)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts, scale=0.3)
    out = paged_attention(query, layer, tables, seq_lens, starts, scale=0.3, backend="triton")
    assert_close(out, expected, torch.float32)


@pytest.mark.heavy
@pytest.mark.parametrize("block_size", [1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_is_bit_identical_to_the_reference(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    reference = KVCache(1, 12, block_size, 2, 64, dtype=dtype).layers[0]
    triton_layer = reference.clone()
    slots = torch.randperm(12 * block_size, generator=gen)[:9]
    slots[::4] = -1  # padding tokens
    key, value = torch.randn(2, 9, 2, 64, generator=gen)  # fp32 in, cast by the store
    reference_store_kv(key, value, reference, slots)
    store_kv(key, value, triton_layer, slots, backend="triton")
    assert torch.equal(reference, triton_layer)


# ---- the wide grid (slow) ----

@pytest.mark.heavy
@pytest.mark.slow
@pytest.mark.parametrize("block_size, group, head_dim",
                         list(itertools.product([1, 2, 4, 8, 16, 32, 64], [1, 2, 7], [64, 128])))
def test_wide_grid(block_size, group, head_dim):
    gen = torch.Generator().manual_seed(block_size * 100 + group * 10 + head_dim)
    lengths = torch.randint(1, 300, (5,), generator=gen).tolist()
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lengths]
    query, layer, tables, seq_lens, starts, _ = make_batch(
        lengths, q_lens, block_size, group=group, head_dim=head_dim, seed=block_size)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(extend_attention(query, layer, tables, seq_lens, starts), expected,
                 torch.float16)
    decode_query = query[starts[1:] - 1]
    decode_starts = torch.arange(len(lengths) + 1)
    expected = reference_paged_attention(decode_query, layer, tables, seq_lens, decode_starts)
    for lookup in ("position", "tile"):
        assert_close(decode_attention(decode_query, layer, tables, seq_lens, lookup=lookup),
                     expected, torch.float16)


def test_tile_sizes_tl_dot_cannot_take_are_refused():
    query, layer, tables, seq_lens, starts, _ = make_batch([5], [1], 4)
    with pytest.raises(ValueError, match="tile_size"):
        decode_attention(query, layer, tables, seq_lens, tile_size=8)
    with pytest.raises(ValueError, match="block_m"):
        extend_attention(query, layer, tables, seq_lens, starts, block_m=12)


# ---- inputs the kernels once read wrongly ----

@pytest.mark.heavy
def test_query_not_contiguous_in_its_last_dimension():
    # A permuted copy holds the same values with the head dimension strided; the kernels
    # index that dimension as contiguous, so the launchers must hand them a contiguous copy.
    query, layer, tables, seq_lens, starts, _ = make_batch([9, 40], [9, 1], 8)
    strided = query.permute(0, 2, 1).contiguous().permute(0, 2, 1)
    assert strided.stride(-1) != 1
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(extend_attention(strided, layer, tables, seq_lens, starts), expected,
                 torch.float16)
    decode_query, decode_starts = strided[starts[1:] - 1], torch.arange(3)
    expected = reference_paged_attention(query[starts[1:] - 1], layer, tables, seq_lens,
                                         decode_starts)
    assert_close(decode_attention(decode_query, layer, tables, seq_lens), expected,
                 torch.float16)


@pytest.mark.heavy
def test_block_table_not_contiguous_in_its_last_dimension():
    # A column-major table used to send the kernels to the wrong (or no) memory.
    query, layer, tables, seq_lens, starts, _ = make_batch([9, 40], [1, 1], 4)
    column_major = tables.t().contiguous().t()
    assert column_major.stride(-1) != 1
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    for lookup in ("position", "tile"):
        assert_close(decode_attention(query, layer, column_major, seq_lens, lookup=lookup),
                     expected, torch.float16)
    assert_close(extend_attention(query, layer, column_major, seq_lens, starts), expected,
                 torch.float16)


@pytest.mark.parametrize("num_splits", [0, 3, -2, 2.0])
def test_num_splits_must_be_a_power_of_two(num_splits):
    query, layer, tables, seq_lens, _, _ = make_batch([5], [1], 4)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(query, layer, tables, seq_lens, num_splits=num_splits)


def test_query_start_loc_must_cover_every_query_token():
    query, layer, tables, seq_lens, starts, _ = make_batch([9, 40], [9, 1], 8)
    with pytest.raises(ValueError, match="query_start_loc"):
        extend_attention(query[:-1], layer, tables, seq_lens, starts)


# ---- what the kernels index, checked on the host before any launch ----

def bad_inputs():
    """(what is wrong, the field the error names, decode arguments) for a 2-sequence batch."""
    query, layer, tables, seq_lens, starts, _ = make_batch([9, 40], [1, 1], 8)
    outside = tables.clone()
    outside[1, 2] = layer.shape[0]  # one past the last block, inside the context
    negative = tables.clone()
    negative[0, 0] = -1
    return query, layer, starts, [
        ("a block id past the pool", "block_tables", outside, seq_lens),
        ("a negative block id", "block_tables", negative, seq_lens),
        ("a context past the table", "block_tables", tables, torch.tensor([9, 8 * 9])),
        ("a context shorter than the query", "seq_lens", tables, torch.tensor([0, 40])),
        ("float lengths", "seq_lens", tables, seq_lens.float()),
        ("float block ids", "block_tables", tables.float(), seq_lens),
    ]


@pytest.mark.parametrize("case", range(6))
def test_wrappers_refuse_what_would_send_a_kernel_outside_the_cache(case):
    # On a GPU these once ended the process (SIGSEGV) or gave NaN: now a ValueError, no launch.
    query, layer, starts, cases = bad_inputs()
    what, field, tables, seq_lens = cases[case]
    before = layer.clone()
    calls = [lambda: decode_attention(query, layer, tables, seq_lens),
             lambda: extend_attention(query, layer, tables, seq_lens, starts),
             lambda: paged_attention(query, layer, tables, seq_lens, starts, backend="triton")]
    for call in calls:
        with pytest.raises(ValueError, match=field):
            call()
    assert torch.equal(layer, before), what


def test_extend_refuses_offsets_that_do_not_rise_to_the_token_count():
    query, layer, tables, seq_lens, _, _ = make_batch([9, 40], [4, 1], 8)
    for starts in ([0, 3, 4], [0, 6, 5], [1, 4, 5]):
        with pytest.raises(ValueError, match="query_start_loc"):
            extend_attention(query, layer, tables, seq_lens, torch.tensor(starts))


def test_contiguous_decode_refuses_a_context_past_its_cache():
    query, _, _, seq_lens, _, contiguous = make_batch([9, 40], [1, 1], 8)
    with pytest.raises(ValueError, match="seq_lens"):
        contiguous_decode_attention(query, contiguous, torch.tensor([9, 41]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_refuses_two_tokens_in_one_slot(backend):
    # On a GPU the two programs would race; the interpreter would silently keep the last one.
    layer = KVCache(1, 4, 4, 2, 64, dtype=torch.float16).layers[0]
    key = torch.randn(3, 2, 64).half()
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, layer, torch.tensor([5, -1, 5]), backend=backend)
    assert not layer.any()
    store_kv(key, key, layer, torch.tensor([5, -1, -1]), backend=backend)  # -1 twice is fine
    assert layer.any()


# ---- the dispatcher's choices ----

def test_tiles_below_compute_8_keep_the_fma_products_in_registers():
    for head_dim in (64, 128, 256):
        assert K._decode_tile(head_dim, 2, 75) == 16
        for group_pad in (1, 2, 8, 16):
            block_m, tile = K._extend_tiles(group_pad, head_dim, 2, 75)
            rows = block_m * group_pad
            assert rows >= 16 and (rows * tile * head_dim <= K.FMA_DOT_PRODUCTS or rows == 16)
    assert K._decode_tile(64, 2, 80) == 64 and K._extend_tiles(8, 64, 2, 80) == (16, 32)


@pytest.mark.parametrize("num_sms, capability", [(40, 75), (108, 80), (132, 90)])
def test_splits_fill_one_wave_and_no_more(num_sms, capability):
    target = K.Target(capability, num_sms)
    resident = num_sms * K._decode_programs_per_sm(capability)
    for num_programs, longest, tile in itertools.product([1, 2, 16, 64, 200, 512],
                                                         [1, 63, 64, 2048, 100_000], [16, 64]):
        splits = K._pick_splits(num_programs, longest, tile, target)
        assert splits >= 1 and splits & (splits - 1) == 0
        if splits > 1:  # every split at least 4 tiles, all programs in one wave
            assert longest >= splits * K.MIN_SPLIT_TILES * tile
            assert num_programs * splits <= resident and splits <= K.MAX_SPLITS
        doubled = 2 * splits  # the largest that does so
        assert (num_programs * doubled > resident or doubled > K.MAX_SPLITS
                or longest < doubled * K.MIN_SPLIT_TILES * tile)
    assert K._pick_splits(2, 2048, 16, K.INTERPRETER) == 1  # the interpreter never splits


class Spy:
    """Stands in for a kernel: records each launch's constants, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.constants = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.constants.append(constants)
            self.kernel[grid](*args, **constants)
        return launch


@pytest.mark.heavy
@pytest.mark.parametrize("block_size, lookup", [(1, "position"), (4, "tile"), (64, "tile")])
def test_the_t4_launches_match_the_reference(block_size, lookup, monkeypatch):
    # The launches a T4 gets (16-position tiles, register prefetch, 4-token extend programs),
    # run under the interpreter: the prefetch reads one tile past the last, masked.
    monkeypatch.setattr(K, "device_target", lambda device: K.Target(75, 0))  # one split
    decode, merge, extend = (Spy(getattr(K, name)) for name in (
        "_decode_kernel", "_merge_splits_kernel", "_extend_kernel"))
    for name, spy in (("_decode_kernel", decode), ("_merge_splits_kernel", merge),
                      ("_extend_kernel", extend)):
        monkeypatch.setattr(K, name, spy)
    query, layer, tables, seq_lens, starts, _ = make_batch([1, 17, 64, 130], [1] * 4, block_size)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    out = decode_attention(query, layer, tables, seq_lens, lookup=lookup)
    assert [c["PREFETCH"] for c in decode.constants] == [True] and merge.constants == []
    assert decode.constants[0]["TILE"] == 16
    assert_close(out, expected, torch.float16)
    query, layer, tables, seq_lens, starts, _ = make_batch([21, 50, 9], [21, 9, 1], block_size)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    out = extend_attention(query, layer, tables, seq_lens, starts)
    assert [c["BLOCK_M"] for c in extend.constants] == [4]
    assert_close(out, expected, torch.float16)


# ---- the step's lengths from the host: the same answer without reading the GPU ----

@pytest.mark.heavy
@pytest.mark.parametrize("query_lengths", [[1, 1, 1, 1], [40, 0, 3, 1]])
def test_lengths_given_by_the_caller_give_the_same_answer(query_lengths):
    # [40, 0, 3, 1]: a sequence with no query token this step leaves its flat-grid block idle.
    context = [40, 123, 67, 90]
    query, layer, tables, seq_lens, starts, _ = make_batch(context, query_lengths, 16)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    out = paged_attention(query, layer, tables, seq_lens, starts, backend="triton",
                          max_seqlen_q=max(query_lengths), max_seqlen_k=max(context),
                          validate=False)
    assert_close(out, expected, torch.float16)
    assert torch.equal(out, paged_attention(query, layer, tables, seq_lens, starts,
                                            backend="triton"))


# ---- compiled for a T4 (sm_75) and an A100 (sm_80) by Triton's own compiler: no GPU ----

ROOT = Path(__file__).resolve().parent.parent

def compile_tool(name: str = "compile_report"):
    """tools/compile_report.py (or compile_check.py) as a module: the table is not the package's."""
    return importlib.import_module(f"tools.{name}")


@pytest.fixture(scope="module")
def fresh_table():
    """Chapter 5's compile table compiled now, under this triton, with the interpreter off (a
    fresh process: the kernels of this one were made for the interpreter)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    run = subprocess.run([sys.executable, "-m", "tools.compile_report", "--json"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0"))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.heavy
def test_kernels_fit_a_t4_and_an_a100_as_the_wrappers_launch_them(fresh_table):
    # The launches the wrappers make (tiles picked per architecture, the JIT's alignment
    # specialisation, num_warps and num_stages), recorded from the wrappers and compiled for
    # compute 7.5 and 8.0; `make compile-check` runs the same checks under the lowest triton
    # the requirements allow.
    check = compile_tool("compile_check")
    assert check.problems(fresh_table) == []
    assert check.split_rule_mismatches(fresh_table) == []  # the split rule counts what it gets


@pytest.mark.heavy
def test_the_committed_compile_table_is_what_this_triton_compiles(fresh_table):
    # Registers, and so programs per SM, change between triton releases (3.4 keeps one split
    # decode program fewer on a T4 than 3.9), so the committed table is compared only under the
    # triton that wrote it; the quick tests below check its tiles under any triton.
    committed = compile_tool().read_csv()
    written_by, installed = committed[0]["triton"], fresh_table[0]["triton"]
    if written_by != installed:
        pytest.skip(f"bench/results/compile_report.csv was compiled by triton {written_by}, "
                    f"this is {installed}")
    assert fresh_table == committed, ("bench/results/compile_report.csv is stale: rerun "
                                      "TRITON_INTERPRET=0 python -m tools.compile_report --write")


def test_the_committed_compile_table_has_the_tiles_the_wrappers_pick_now():
    # Recorded from the wrappers without compiling: a change to the dispatcher that leaves the
    # committed table behind fails here, under any triton, in seconds.
    tool = compile_tool()
    committed = tool.read_csv()
    assert len({row["triton"] for row in committed}) == 1
    recorded = [{"kernel": name, "GPU": tool.GPU_NAMES[capability], "head dim": head_dim,
                 "tiles": tool.tiles(launch)}
                for capability, head_dim, name, launch in tool.table_rows()]
    assert [{k: row[k] for k in recorded[0]} for row in committed] == recorded, (
        "bench/results/compile_report.csv is stale: rerun "
        "TRITON_INTERPRET=0 python -m tools.compile_report --write")


def test_the_split_rule_counts_what_the_committed_table_compiles():
    tool = compile_tool()
    committed = tool.read_csv()
    for capability, gpu in tool.GPU_NAMES.items():
        decode = next(r for r in committed if (r["kernel"], r["GPU"], r["head dim"])
                      == ("decode", gpu, 64))
        assert K._decode_programs_per_sm(capability) == decode["programs / SM"], gpu
    assert K._decode_programs_per_sm(90) == K._decode_programs_per_sm(80)  # Ampere's on


def test_chapter_5_shows_the_compile_tool_as_it_stands():
    # The chapter's second page displays two pieces of tools/compile_report.py (it cannot run
    # them): each must be the tool's text, verbatim.
    chapter = (ROOT / "chapters" / "05_what_the_table_costs.md").read_text()
    shown = re.findall(r"```\{code-block\} python\n:caption: tools/compile_report.py[^\n]*\n\n"
                       r"(.*?)\n```", chapter, flags=re.S)
    assert len(shown) == 2
    source = (ROOT / "tools" / "compile_report.py").read_text()
    for snippet in shown:
        assert snippet in source, snippet[:200]


@pytest.mark.heavy
def test_the_compile_table_specialises_arguments_as_the_jit_does():
    # launch_source builds the compiler's input with public API only; where this triton still
    # has the JIT's private packing step, the two must agree argument by argument.
    pytest.importorskip("triton.backends.nvidia.compiler")
    code = ("import json; from tools.compile_check import jit_disagreements; "
            "print(json.dumps(jit_disagreements()))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, TRITON_INTERPRET="0"), timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    disagreements = json.loads(run.stdout.splitlines()[-1])
    if disagreements is None:
        pytest.skip("this triton has no JITFunction._pack_args to compare with")
    assert disagreements == []


def test_programs_per_sm_by_hand():
    programs_per_sm = compile_tool().programs_per_sm
    # T4: 128 registers x 128 threads = a quarter of the SM's registers; warps allow 8.
    assert programs_per_sm(75, 128, 8192, 4) == 4
    assert programs_per_sm(75, 255, 0, 4) == 2  # 256 registers a thread after rounding
    assert programs_per_sm(75, 32, 48 * 1024, 4) == 1  # shared memory binds
    assert programs_per_sm(80, 64, 20 * 1024, 4) == 7  # 164 KiB / (20 + 1 reserved) KiB


# ---- the batched CPU path against the reference ----

from dataclasses import fields  # noqa: E402

from hypothesis import assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minipaged.kernels import (  # noqa: E402
    CAUSAL_ROWS,
    DECODE_GROUP_SIZE,
    DECODE_GROUPS,
    PIECE_ROWS,
    BatchedGroup,
    _plan_group,
    _runs,
    batched_paged_attention,
    plan_batched_attention,
    resolve_backend,
)


def test_backends_name_the_reference_and_the_batched_path():
    assert resolve_backend("auto", torch.zeros(1)) == "batched"
    assert resolve_backend("torch", torch.zeros(1)) == "torch"
    query, layer, tables, seq_lens, starts, _ = make_batch([5, 40], [5, 1], 16,
                                                           dtype=torch.float32)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    torch_out = paged_attention(query, layer, tables, seq_lens, starts, backend="torch")
    assert torch.equal(torch_out, expected)  # "torch" is chapter 4's reference, exactly
    auto = paged_attention(query, layer, tables, seq_lens, starts)
    assert torch.equal(auto, paged_attention(query, layer, tables, seq_lens, starts,
                                             backend="batched"))
    assert_close(auto, expected, torch.float32)


@st.composite
def mixed_batches(draw):
    """Sequences that decode, prefill, extend a cached context, or bring no token at all."""
    num_seqs = draw(st.integers(1, 6))
    contexts, queries = [], []
    for _ in range(num_seqs):
        kind = draw(st.sampled_from(["decode", "prefill", "extend", "idle"]))
        context = draw(st.integers(1, 70))
        query = {"decode": 1, "prefill": context, "idle": 0,
                 "extend": draw(st.integers(1, context))}[kind]
        contexts.append(context)
        queries.append(query)
    return contexts, queries


@pytest.mark.heavy
@settings(max_examples=60, deadline=None)
@given(batch=mixed_batches(), block_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
       heads=st.sampled_from([(1, 1), (1, 4), (2, 7), (3, 2), (4, 1)]),
       head_dim=st.sampled_from([8, 16, 64]), seed=st.integers(0, 2**16),
       causal_rows=st.sampled_from([1, 2, 33, CAUSAL_ROWS]))
def test_batched_matches_the_reference_on_any_mixed_batch(batch, block_size, heads, head_dim,
                                                          seed, causal_rows):
    (contexts, queries), (num_kv_heads, group) = batch, heads
    assume(sum(queries) > 0)  # a step computes at least one token
    query, layer, tables, seq_lens, starts, _ = make_batch(
        contexts, queries, block_size, num_kv_heads, group, head_dim, torch.float32, seed)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts, scale=0.3)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size,
                                  causal_rows)  # short thresholds: whole prompts at any length
    out = paged_attention(query, layer, tables, seq_lens, starts, scale=0.3, backend="batched",
                          plan=plan)
    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_batched_keeps_the_query_dtype_and_computes_in_fp32(dtype):
    query, layer, tables, seq_lens, starts, _ = make_batch([40, 123, 67, 90], [40, 23, 3, 1], 8,
                                                           dtype=dtype)
    out = paged_attention(query, layer, tables, seq_lens, starts, backend="batched")
    assert out.dtype == dtype
    assert_close(out, reference_paged_attention(query, layer, tables, seq_lens, starts), dtype)


def _pieces(group, starts):
    """(sequence, first token, rows) of each piece of a group, read from its real rows."""
    pieces = []
    for tokens, valid in zip(group.tokens.tolist(), group.valid.tolist()):
        real = [t for t, v in zip(tokens, valid) if v]
        assert real == list(range(real[0], real[0] + len(real)))  # consecutive tokens
        seq = int(torch.searchsorted(starts, real[0], right=True)) - 1
        assert real[-1] < int(starts[seq + 1])  # all of one sequence
        pieces.append((seq, real[0], len(real)))
    return pieces


def test_plan_cuts_longer_queries_into_pieces_and_keeps_decodes_apart():
    query_lens = [1, 5, 1, 3, 80, 1, 2, 0]
    contexts = [10, 5, 30, 9, 100, 2, 40, 7]
    _, _, tables, seq_lens, starts, _ = make_batch(contexts, query_lens, 4)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=4)
    pieces = [_pieces(g, starts) for g in plan.groups]
    assert sorted(seq for seq, _, _ in pieces[0]) == [0, 2, 5]  # the decodes, one group
    longer = [p for group in pieces[1:] for p in group]
    assert all(rows > 1 or query_lens[seq] > 1 for seq, _, rows in longer)
    assert max(rows for _, _, rows in longer) == PIECE_ROWS
    assert sorted(rows for seq, _, rows in longer if seq == 4) == [16, 32, 32]  # 80 cut in 3
    tokens = sorted(t for group in pieces for _, first, rows in group
                    for t in range(first, first + rows))
    assert tokens == list(range(sum(query_lens)))  # every query token once; the idle in none


def test_plan_masks_each_row_up_to_its_own_position_through_its_own_blocks():
    query_lens = [1] * 6 + [70, 5, 33]
    contexts = [3, 90, 17, 40, 64, 8, 70, 45, 200]
    _, _, tables, seq_lens, starts, _ = make_batch(contexts, query_lens, 8)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=8)
    for group in plan.groups:
        for row, (seq, first, rows) in enumerate(_pieces(group, starts)):
            for r in range(rows):
                position = contexts[seq] - query_lens[seq] + (first - int(starts[seq])) + r
                allowed = group.mask[row, 0, r] == 0
                assert allowed.nonzero().flatten().tolist() == list(range(position + 1))
            needed = -(-(position + 1) // 8)  # the blocks the last row reads: the table's own
            assert torch.equal(group.blocks[row, :needed], tables[seq, :needed].long())


def test_plan_splits_decodes_and_pieces_by_context_length():
    contexts = [30 + 23 * i for i in range(20)][::-1] + [12, 200, 40, 50, 60]
    query_lens = [1] * 20 + [12, 16, 40, 50, 60]
    query, layer, tables, seq_lens, starts, _ = make_batch(contexts, query_lens, 16,
                                                           dtype=torch.float32)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=16)
    seqs = [[seq for seq, _, _ in _pieces(g, starts)] for g in plan.groups]
    assert seqs[0] == sorted(range(10, 20), key=contexts.__getitem__)  # the 10 shortest
    assert seqs[1] == sorted(range(10), key=contexts.__getitem__)
    # eight pieces of at most 32 rows; a piece's context ends at its last row
    ends = [sorted(contexts[seq] - query_lens[seq] + first - int(starts[seq]) + rows
                   for seq, first, rows in _pieces(g, starts)) for g in plan.groups[2:]]
    assert ends == [[12, 32, 32, 32], [40, 50, 60, 200]]
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(batched_paged_attention(query, layer, plan), expected, torch.float32)


@pytest.mark.parametrize("num_decodes", [1, 7, 8, 17, 40])
def test_decode_groups_planned_in_one_pass_hold_what_each_group_planned_alone_would(num_decodes):
    generator = torch.Generator().manual_seed(num_decodes)
    contexts = torch.randint(1, 300, (num_decodes,), generator=generator).tolist() + [50]
    _, _, tables, seq_lens, starts, _ = make_batch(contexts, [1] * num_decodes + [20], 16)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=16)
    decodes = [(c, s, s, 1) for s, c in enumerate(contexts[:-1])]
    runs = _runs(decodes, DECODE_GROUP_SIZE, DECODE_GROUPS)
    assert len(plan.groups) == len(runs) + 1  # and one group for the prompt's piece
    for group, run in zip(plan.groups, runs):
        alone = _plan_group(run, tables.numpy(), 16, tables.device)
        for field in fields(BatchedGroup):
            assert torch.equal(getattr(group, field.name), getattr(alone, field.name)), field.name


def test_a_long_prompt_with_nothing_cached_is_one_causal_piece_and_matches_the_reference():
    # a fresh prompt at the threshold, one past it, a chunk of the same length after cached
    # context, a short fresh prompt and two decodes
    contexts = [CAUSAL_ROWS, CAUSAL_ROWS + 77, CAUSAL_ROWS + 40, 60, 300, 9]
    query_lens = [CAUSAL_ROWS, CAUSAL_ROWS + 77, CAUSAL_ROWS, 60, 1, 1]
    query, layer, tables, seq_lens, starts, _ = make_batch(contexts, query_lens, 16, 1, 2, 16,
                                                           dtype=torch.float32)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=16)
    wholes = [g for g in plan.groups if g.mask is None]
    assert [_pieces(g, starts) for g in wholes] == [[(0, 0, CAUSAL_ROWS)],
                                                    [(1, CAUSAL_ROWS, CAUSAL_ROWS + 77)]]
    assert [tuple(g.blocks.shape) for g in wholes] == [(1, CAUSAL_ROWS // 16),
                                                       (1, -(-(CAUSAL_ROWS + 77) // 16))]
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert_close(batched_paged_attention(query, layer, plan), expected, torch.float32)
    cut = plan_batched_attention(tables, seq_lens, starts, block_size=16,
                                 causal_rows=CAUSAL_ROWS + 78)  # nothing long enough: pieces
    assert all(g.mask is not None for g in cut.groups)
    assert_close(batched_paged_attention(query, layer, cut), expected, torch.float32)


def test_a_plan_serves_every_layer_of_the_step():
    query, layer, tables, seq_lens, starts, _ = make_batch([40, 123, 67, 90], [40, 23, 3, 1], 8,
                                                           dtype=torch.float32)
    plan = plan_batched_attention(tables, seq_lens, starts, block_size=8)
    other_layer = torch.randn_like(layer)
    for cache in (layer, other_layer):
        expected = reference_paged_attention(query, cache, tables, seq_lens, starts)
        assert_close(batched_paged_attention(query, cache, plan), expected, torch.float32)


@pytest.mark.parametrize("case", ["block past the pool", "too few heads", "short table"])
def test_batched_refuses_what_it_cannot_read(case):
    query, layer, tables, seq_lens, starts, _ = make_batch([5, 40], [5, 1], 16,
                                                           dtype=torch.float32)
    if case == "block past the pool":
        tables[1, 0] = layer.shape[0]
        match = "block_tables"
    elif case == "too few heads":
        query = query[:, :3]
        match = "heads"
    else:
        tables = tables[:, :1]
        match = "block_tables"
    with pytest.raises(ValueError, match=match):
        paged_attention(query, layer, tables, seq_lens, starts, backend="batched")
