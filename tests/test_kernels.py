"""The Triton kernels against chapter 4's plain-torch reference, under Triton's interpreter."""
import itertools

import pytest
import torch

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

@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_check_block_size_accepts_powers_of_two(block_size):
    assert check_block_size(block_size) == block_size


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 24, 512, 16.0, True])
def test_check_block_size_names_the_block_size(block_size):
    with pytest.raises(ValueError, match="block_size"):
        check_block_size(block_size)


def test_auto_backend_on_cpu_is_the_reference_exactly():
    query, layer, tables, seq_lens, starts, _ = make_batch([5, 40], [5, 1], 16,
                                                           dtype=torch.float32)
    expected = reference_paged_attention(query, layer, tables, seq_lens, starts)
    assert torch.equal(paged_attention(query, layer, tables, seq_lens, starts), expected)


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


# ---- compiled for a T4 (sm_75) by Triton's own compiler: no GPU needed ----

T4_SHARED_MEMORY = 64 * 1024  # the most shared memory one program may use on compute 7.5
WITHOUT_OPT_IN = 48 * 1024  # what any GPU since Volta grants a program without asking

COMPILE_FOR_T4 = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minipaged import kernels as K

TARGET = GPUTarget("cuda", 75, 32)
FLOATS = {"scale_log2"}


def compile_shared(kernel, dtype, constants, table="i32"):
    """Compile kernel for sm_75 with every pointer typed; return its shared memory in bytes."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name in ("table_ptr", "seq_lens_ptr", "query_start_ptr"):
            signature[name] = "*" + table
        elif name == "slot_mapping_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*" + dtype
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=TARGET)
    return compiled.metadata.shared


results = []
for dtype, size in (("fp16", 2), ("fp32", 4)):
    precision = "ieee" if dtype == "fp32" else None
    for head_dim in (64, 128, 256):
        tile = K._decode_tile(head_dim, size)
        # The lookups differ in address arithmetic only: per tile at one shape is enough.
        lookups = ((False, 16), (True, 8)) if (dtype, head_dim) == ("fp16", 64) else ((False, 16),)
        for per_tile, block_size in lookups:
            constants = dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=head_dim, PAGED=True,
                             PER_TILE=per_tile, BLOCK_SIZE=block_size, TILE=tile,
                             NUM_SPLITS=4, PRECISION=precision)
            results.append(("decode", dtype, head_dim, block_size,
                            compile_shared(K._decode_kernel, dtype, constants)))
        for group in ((1, 7) if (dtype, head_dim) == ("fp16", 64) else (7,)):
            group_pad = triton.next_power_of_2(group)
            block_m, tile = K._extend_tiles(group_pad, head_dim, size)
            constants = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
                             BLOCK_SIZE=16, BLOCK_M=block_m, TILE=tile, PRECISION=precision)
            results.append(("extend", dtype, head_dim, group,
                            compile_shared(K._extend_kernel, dtype, constants)))
results.append(("merge", "fp16", 64, 64, compile_shared(
    K._merge_splits_kernel, "fp16", dict(HEAD_DIM=64, NUM_SPLITS=64))))
results.append(("store", "fp16", 64, 16, compile_shared(
    K._store_kv_kernel, "fp16", dict(HEAD_DIM=64, WIDTH=128, WIDTH_PAD=128, BLOCK_SIZE=16))))
json.dump(results, sys.stdout)
'''


@pytest.mark.heavy
def test_kernels_compile_for_a_t4_within_its_shared_memory():
    # The interpreter accepts what the GPU compiler may refuse, so compile for compute 7.5
    # (fp16 on FMA units) in a fresh process with the interpreter off, at the tile sizes the
    # launchers pick, and check each program fits the shared memory any GPU grants by default.
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", COMPILE_FOR_T4], capture_output=True,
                         text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout)
    too_big = [row for row in results if row[-1] > min(WITHOUT_OPT_IN, T4_SHARED_MEMORY)]
    assert not too_big, too_big
    assert len(results) == 16
