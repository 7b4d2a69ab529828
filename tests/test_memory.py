"""Chapter 1: bytes per token, reservations, and the cache budget."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minipaged.memory import (
    PRESETS,
    QWEN2_5_0_5B,
    GiB,
    MiB,
    ModelShape,
    SimulatedDevice,
    allocate_until_refused,
    cache_budget,
    parameter_bytes,
    peak_forward_bytes,
)


def test_preset_costs_twelve_kib_per_token_and_24_mib_per_reservation():
    assert QWEN2_5_0_5B.kv_bytes_per_token == 12 * 1024
    assert QWEN2_5_0_5B.reservation_bytes(2048) == 24 * MiB
    assert QWEN2_5_0_5B.group_size == 7


def test_bytes_per_token_matches_an_actual_cache_tensor():
    # Build the cache a model of each shape would hold for 3 tokens and count its bytes.
    for shape in PRESETS.values():
        per_layer = torch.empty(2, 3, shape.num_kv_heads, shape.head_dim, dtype=torch.float16)
        total = shape.num_layers * per_layer.numel() * per_layer.element_size()
        assert total == 3 * shape.kv_bytes_per_token


@pytest.mark.parametrize("field", ["num_layers", "num_query_heads", "num_kv_heads", "head_dim"])
def test_zero_in_any_shape_field_is_refused_by_name(field):
    values = dict(num_layers=24, num_query_heads=14, num_kv_heads=2, head_dim=64)
    values[field] = 0
    with pytest.raises(ValueError, match=field):
        ModelShape("bad", **values)


def test_query_heads_must_divide_among_kv_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelShape("bad", 2, 14, 3, 64)


def test_negative_length_is_refused():
    with pytest.raises(ValueError, match="max_len"):
        QWEN2_5_0_5B.reservation_bytes(-1)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.01, float("nan")])
def test_utilization_outside_zero_one_is_refused(utilization):
    with pytest.raises(ValueError, match="utilization"):
        cache_budget(16 * GiB, 2 * GiB, 12288, utilization)


def test_seed_t4_allocates_573_reservations_and_returns_every_byte():
    weights_and_context = QWEN2_5_0_5B.weight_bytes + 210 * MiB
    device = SimulatedDevice(15_635_820_328, weights_and_context)
    assert allocate_until_refused(device.allocate, device.release, 24 * MiB) == 573
    assert device.used_bytes == weights_and_context


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
@given(total=st.integers(1, 10**6), chunk=st.integers(1, 10**4))
def test_allocate_until_refused_counts_floor_of_free_over_chunk(total, chunk):
    device = SimulatedDevice(total)
    assert allocate_until_refused(device.allocate, device.release, chunk) == total // chunk
    assert device.used_bytes == 0


def test_budget_reproduces_the_seed_pool_and_the_equal_budget_reservations():
    budget = cache_budget(15_635_820_328, 1_864_350_882, 12288, 0.85)
    assert budget.num_tokens == 929_856 and budget.num_blocks == 58_116
    assert (58_064 * 16 * 12288) // (24 * MiB) == 453


@given(u=st.floats(0.05, 1.0), non_cache=st.integers(0, 4 * GiB))
def test_budget_is_whole_blocks_and_never_exceeds_what_is_left(u, non_cache):
    budget = cache_budget(16 * GiB, non_cache, 12288, u)
    assert budget.num_tokens % 16 == 0
    assert budget.num_tokens * 12288 <= max(0, u * 16 * GiB - non_cache) + 1


@pytest.mark.heavy  # seconds: the profiler records a whole forward pass
def test_cpu_peak_of_a_forward_counts_its_largest_live_tensor():
    size = 4 * MiB

    def run():
        a = torch.empty(size // 4, dtype=torch.float32)
        b = torch.empty(size // 4, dtype=torch.float32)
        del a, b

    peak = peak_forward_bytes(run, "cpu")
    assert 2 * size <= peak < 2 * size + MiB


def test_parameter_bytes_counts_parameters_and_buffers():
    layer = torch.nn.BatchNorm1d(10)
    assert parameter_bytes(layer) == (10 + 10 + 10 + 10 + 1) * 4 + 4  # weight, bias, stats, count
