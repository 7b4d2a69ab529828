"""Chapter 5's public entry points, run as a T4 runs them: data on the GPU, some indices maybe not.

CI has no GPU. tests/pretend_gpu.py marks tensors as living on a GPU while their data stays on
the CPU, and fails any torch call that mixes devices as CUDA does, so a line such as
``starts[members]`` with ``starts`` on the CPU and ``members`` on the GPU (the bug chapter 5
shipped) fails here as it failed on Colab. Each entry point is driven twice: with every tensor on
the GPU, and with the query offsets left on the CPU as chapter 5's cells made them; the answer
must equal the all-CPU answer.
"""
from __future__ import annotations

import pytest
import torch
from pretend_gpu import GPU, PretendGPU
from test_kernels import TOLERANCE, make_batch

from minipaged import kernels as K
from minipaged.model import prepare_metadata

CONTEXTS, QUERIES = [40, 123, 67, 90], [40, 23, 3, 1]  # prefill, chunk, prefix hit, decode


def on_gpu(mode: PretendGPU, *tensors):
    return tuple(mode.gpu(t.clone()) for t in tensors)


def close(actual, expected) -> bool:
    return (actual.float() - expected.float()).abs().max().item() <= TOLERANCE[expected.dtype]


@pytest.fixture
def batch():
    return make_batch(CONTEXTS, QUERIES, block_size=8)


def test_pretend_gpu_refuses_what_cuda_refuses():
    mode = PretendGPU()
    with mode:
        members = mode.gpu(torch.tensor([0, 2]))
        assert members.device == GPU and members.is_cuda
        starts = torch.tensor([0, 5, 9])
        with pytest.raises(RuntimeError, match="mixes tensors on the GPU and on the CPU"):
            starts[members]  # a CPU tensor indexed by a GPU one: chapter 5's bug
        with pytest.raises(RuntimeError, match="mixes"):
            members + starts[:2]
        assert members[torch.tensor([1])].device == GPU  # a CPU index into a GPU tensor is fine
        assert (members + torch.tensor(1)).device == GPU  # and so is a CPU scalar
        assert torch.arange(3, device=members.device).device == GPU
        moved = starts.to(members.device)
        assert moved.device == GPU and starts.device == torch.device("cpu")
        assert members.cpu().device == torch.device("cpu") and members.device == GPU


@pytest.mark.parametrize("starts_on_gpu", [True, False], ids=["all on the GPU", "starts on CPU"])
def test_the_batched_plan_and_path_keep_one_device(batch, starts_on_gpu):
    query, layer, tables, seq_lens, starts, _ = batch
    expected = K.paged_attention(query, layer, tables, seq_lens, starts, backend="batched")
    mode = PretendGPU()
    with mode:
        g_query, g_layer, g_tables, g_lens = on_gpu(mode, query, layer, tables, seq_lens)
        g_starts = mode.gpu(starts.clone()) if starts_on_gpu else starts
        plan = K.plan_batched_attention(g_tables, g_lens, g_starts, block_size=8)
        assert all(group.blocks.device == GPU for group in plan.groups)
        planned = K.batched_paged_attention(g_query, g_layer, plan)
        through = K.paged_attention(g_query, g_layer, g_tables, g_lens, g_starts,
                                    backend="batched")
        assert planned.device == GPU and through.device == GPU
    assert close(planned, expected) and close(through, expected)


def test_a_plan_for_another_device_is_refused_by_name(batch):
    query, layer, tables, seq_lens, starts, _ = batch
    plan = K.plan_batched_attention(tables, seq_lens, starts, block_size=8)  # on the CPU
    mode = PretendGPU()
    with mode:
        g_query, g_layer = on_gpu(mode, query, layer)
        with pytest.raises(ValueError, match="the plan must be on one device"):
            K.batched_paged_attention(g_query, g_layer, plan)


@pytest.mark.heavy  # the Triton kernels under the interpreter
@pytest.mark.parametrize("starts_on_gpu", [True, False], ids=["all on the GPU", "starts on CPU"])
def test_the_triton_and_reference_paths_keep_one_device(batch, starts_on_gpu):
    query, layer, tables, seq_lens, starts, _ = batch
    expected = K.paged_attention(query, layer, tables, seq_lens, starts, backend="torch")
    decodes = torch.arange(len(CONTEXTS) + 1)
    decode_query = query[starts[1:] - 1]  # each sequence's last token
    expected_decode = K.paged_attention(decode_query, layer, tables, seq_lens, decodes,
                                        backend="torch")
    mode = PretendGPU()
    with mode:
        g_query, g_layer, g_tables, g_lens, g_decode = on_gpu(mode, query, layer, tables,
                                                              seq_lens, decode_query)
        g_starts = mode.gpu(starts.clone()) if starts_on_gpu else starts
        answers = {backend: K.paged_attention(g_query, g_layer, g_tables, g_lens, g_starts,
                                              backend=backend)
                   for backend in ("torch", "triton", "auto")}
        answers["extend"] = K.extend_attention(g_query, g_layer, g_tables, g_lens, g_starts)
        decoded = K.decode_attention(g_decode, g_layer, g_tables, g_lens)
    for name, answer in answers.items():
        assert close(answer, expected), name
    assert close(decoded, expected_decode)


@pytest.mark.heavy  # the Triton store under the interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_store_keeps_one_device(backend):
    layer = torch.zeros(4, 2, 8, 128, dtype=torch.float16)
    key, value = torch.randn(2, 5, 2, 64).half()
    slots = torch.tensor([0, 9, 17, -1, 31])
    expected = layer.clone()
    K.store_kv(key, value, expected, slots, backend=backend)
    mode = PretendGPU()
    with mode:
        g_layer, g_key, g_value = on_gpu(mode, layer, key, value)
        K.store_kv(g_key, g_value, g_layer, slots, backend=backend)  # slots left on the CPU
    assert torch.equal(g_layer, expected)


def test_the_model_metadata_is_built_on_one_device():
    mode = PretendGPU()
    with mode:
        metadata = prepare_metadata([[3, 1], [0]], [5, 0], [1, 4], block_size=4, device=GPU)
        for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping", "positions"):
            assert getattr(metadata, name).device == GPU, name
