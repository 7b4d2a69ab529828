"""The paged KV cache (chapter 4): store, gather, and the reference attention against SDPA."""
import pytest
import torch
import torch.nn.functional as F

from minipaged.kv_cache import KVCache, gather_kv, reference_paged_attention, reference_store_kv


def test_cache_layout_is_one_tensor_per_layer():
    cache = KVCache(num_layers=3, num_blocks=5, block_size=8, num_kv_heads=2, head_dim=4,
                    dtype=torch.float16)
    assert len(cache.layers) == 3
    assert all(t.shape == (5, 2, 8, 8) and t.dtype == torch.float16 for t in cache.layers)
    assert cache.num_bytes == 3 * 5 * 2 * 8 * 8 * 2


@pytest.mark.parametrize("field,kwargs", [
    ("block_size", dict(block_size=12)),
    ("block_size", dict(block_size=0)),
    ("num_blocks", dict(num_blocks=0)),
    ("num_kv_heads", dict(num_kv_heads=0)),
])
def test_bad_cache_shapes_raise(field, kwargs):
    args = dict(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4) | kwargs
    with pytest.raises(ValueError, match=field):
        KVCache(**args)


@pytest.mark.heavy  # over a second: make check leaves it to make test
def test_store_then_gather_round_trips_and_skips_padding():
    layer = KVCache(1, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=3).layers[0]
    key, value = torch.randn(6, 2, 3), torch.randn(6, 2, 3)
    table = [3, 1]
    slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(5)] + [-1])
    reference_store_kv(key, value, layer, slots)
    keys, values = gather_kv(layer, table, 5, num_kv_heads=2)
    torch.testing.assert_close(keys, key[:5])
    torch.testing.assert_close(values, value[:5])
    assert layer[[0, 2]].abs().sum() == 0  # untouched blocks stay zero


@pytest.mark.parametrize("bad_slot", [16, 100, -2])
def test_a_slot_outside_the_pool_is_refused(bad_slot):
    layer = KVCache(1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2).layers[0]
    with pytest.raises(ValueError, match="slot"):
        reference_store_kv(torch.ones(2, 1, 2), torch.ones(2, 1, 2), layer,
                           torch.tensor([0, bad_slot]))
    assert layer.abs().sum() == 0


def scatter_sequences(seq_lens, block_size, num_blocks, generator):
    """Block tables for the sequences, over a random permutation of the pool's blocks."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-n // block_size) for n in seq_lens)
    tables = torch.full((len(seq_lens), width), 10**6, dtype=torch.int32)  # pad never read
    for s, n in enumerate(seq_lens):
        for b in range(-(-n // block_size)):
            tables[s, b] = order.pop()
    return tables


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_matches_sdpa_on_scattered_blocks(group, block_size):
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    num_kv_heads, head_dim = 2, 8
    num_heads = num_kv_heads * group
    seq_lens = [1, 37, 20, 5]
    q_lens = [1, 1, 20, 3]  # decode, decode, full prefill, chunked prefill
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    layer = KVCache(1, num_blocks, block_size, num_kv_heads, head_dim).layers[0]
    tables = scatter_sequences(seq_lens, block_size, num_blocks, gen)
    queries, expected = [], []
    for s, (n, q_len) in enumerate(zip(seq_lens, q_lens)):
        k, v = torch.randn(n, num_kv_heads, head_dim, generator=gen), torch.randn(
            n, num_kv_heads, head_dim, generator=gen)
        slots = torch.tensor([int(tables[s, p // block_size]) * block_size + p % block_size
                              for p in range(n)])
        reference_store_kv(k, v, layer, slots)
        q = torch.randn(q_len, num_heads, head_dim, generator=gen)
        mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        queries.append(q)
        expected.append(ref.transpose(0, 1))
    starts = torch.tensor([0] + q_lens).cumsum(0)
    out = reference_paged_attention(torch.cat(queries), layer, tables, torch.tensor(seq_lens),
                                    starts)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_reference_keeps_the_query_dtype_and_honours_scale():
    layer = KVCache(1, 4, 4, 1, 4, dtype=torch.float16).layers[0]
    reference_store_kv(torch.randn(3, 1, 4), torch.randn(3, 1, 4), layer, torch.tensor([4, 5, 6]))
    q = torch.randn(1, 2, 4, dtype=torch.float16)
    args = (layer, torch.tensor([[1]]), torch.tensor([3]), torch.tensor([0, 1]))
    out = reference_paged_attention(q, *args)
    assert out.dtype == torch.float16
    assert not torch.allclose(out, reference_paged_attention(q, *args, scale=0.0))


def test_bad_batch_metadata_raises():
    layer = KVCache(1, 4, 4, 1, 4).layers[0]
    q = torch.randn(2, 1, 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        reference_paged_attention(q, layer, torch.tensor([[0]]), torch.tensor([2]),
                                  torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="seq_lens"):
        reference_paged_attention(q, layer, torch.tensor([[0]]), torch.tensor([1]),
                                  torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="block_tables"):
        reference_paged_attention(q, layer, torch.tensor([[0]]), torch.tensor([5]),
                                  torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="block"):
        reference_paged_attention(q, layer, torch.tensor([[9]]), torch.tensor([2]),
                                  torch.tensor([0, 2]))


@pytest.mark.parametrize("slots", [torch.tensor([9.7]), torch.tensor([True]), [0.5]])
def test_store_refuses_slots_that_are_not_integers_and_writes_nothing(slots):
    layer = KVCache(1, 4, 4, 1, 2).layers[0]
    one = torch.ones(1, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping must hold integers"):
        reference_store_kv(one, one, layer, slots)
    assert not layer.any()


def test_store_refuses_key_and_value_on_different_devices_and_writes_nothing():
    layer = KVCache(1, 4, 4, 1, 2).layers[0]
    with pytest.raises(ValueError, match="one device"):
        reference_store_kv(torch.ones(1, 1, 2), torch.empty(1, 1, 2, device="meta"), layer,
                           torch.tensor([0]))
    assert not layer.any()


def test_gather_refuses_float_block_ids_and_lengths():
    layer = KVCache(1, 4, 4, 1, 2).layers[0]
    with pytest.raises(ValueError, match="block_ids must hold integers"):
        gather_kv(layer, torch.tensor([1.7]), 1, 1)
    with pytest.raises(ValueError, match="length"):
        gather_kv(layer, [0, 1], 6.0, 1)
