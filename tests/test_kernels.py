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
