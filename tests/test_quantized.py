"""Chapter 14's 8-bit formats, cache and kernels against references: torch's own float8 casts,
the widen-then-attend reference, and the fp32 layer they came from."""
import pytest
import torch
import triton
import triton.language as tl

from minipaged.kernels import plan_batched_attention
from minipaged.quantized import (
    E4M3_MAX,
    FORMAT_IDS,
    FORMATS,
    QuantizedKVCache,
    _fp8_to_float,
    check_kv_cache_dtype,
    check_kv_scale,
    dequantize_layer,
    e4m3_to_float,
    e5m2_to_fp16,
    float_to_e4m3,
    fp16_to_e5m2,
    int8_dequantize,
    int8_quantize,
    quantized_paged_attention,
    quantized_store_kv,
)

EVERY_CODE = torch.arange(256, dtype=torch.int32).to(torch.uint8)
EVERY_FP16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)


def same(a, b):
    """Equal, NaN where the other is NaN."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_e5m2_is_torchs_cast_for_every_fp16_and_every_code():
    ours, torchs = fp16_to_e5m2(EVERY_FP16), EVERY_FP16.to(torch.float8_e5m2).view(torch.uint8)
    finite = ~EVERY_FP16.isnan()
    assert torch.equal(ours[finite], torchs[finite])
    assert bool(e5m2_to_fp16(ours[~finite]).isnan().all())
    assert same(e5m2_to_fp16(EVERY_CODE), EVERY_CODE.view(torch.float8_e5m2).half())


def test_e4m3_is_torchs_cast_after_clipping_to_448():
    assert same(e4m3_to_float(EVERY_CODE), EVERY_CODE.view(torch.float8_e4m3fn).float())
    values = torch.cat([EVERY_FP16.float()[~EVERY_FP16.isnan()],
                        torch.randn(10000) * torch.exp(3 * torch.randn(10000)),
                        torch.tensor([448.0, 449.0, 464.0, 1e9, -1e9, 2.0**-9, 2.0**-10])])
    ours = float_to_e4m3(values)
    assert torch.equal(ours, values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
                       .view(torch.uint8))
    assert float(e4m3_to_float(float_to_e4m3(torch.tensor([1e6]))).item()) == E4M3_MAX  # clipped


def test_int8_round_trip_is_within_half_a_step_and_uses_the_full_range():
    x = torch.randn(50, 2, 64) * torch.rand(50, 2, 1) * 10
    codes, scales = int8_quantize(x)
    assert bool(((int8_dequantize(codes, scales) - x).abs() <= scales[..., None] / 2 + 1e-5).all())
    assert bool((codes.view(torch.int8).abs().amax(-1) == 127).all())
    zero_codes, zero_scales = int8_quantize(torch.zeros(1, 1, 8))  # a zero head: scale floor
    assert bool((zero_scales > 0).all()) and bool((zero_codes == 0).all())


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, FORMAT: tl.constexpr):
    offsets = tl.arange(0, 256)
    tl.store(out_ptr + offsets, _fp8_to_float(tl.load(codes_ptr + offsets), FORMAT))


@pytest.mark.parametrize("name,torch_dtype", [("fp8_e5m2", torch.float8_e5m2),
                                              ("fp8_e4m3", torch.float8_e4m3fn)])
def test_the_kernels_integer_widening_matches_torch_for_all_256_codes(name, torch_dtype):
    out = torch.empty(256)
    _widen_kernel[(1,)](EVERY_CODE, out, FORMAT=FORMAT_IDS[name])
    assert same(out, EVERY_CODE.view(torch_dtype).float())


def random_batch(kv_format, block_size, lens, query_lens, num_kv_heads=2, group=3, head_dim=16,
                 k_scale=0.5, v_scale=0.25, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-length // block_size) for length in lens]
    cache = QuantizedKVCache(1, sum(blocks) + 2, block_size, num_kv_heads, head_dim, kv_format)
    cache.layers[0].copy_(torch.randint(0, 120, cache.layers[0].shape, generator=generator))
    order = torch.randperm(sum(blocks) + 2, generator=generator).tolist()
    tables = [[order.pop() for _ in range(n)] + [0] * (max(blocks) - n) for n in blocks]
    for table, length in zip(tables, lens):
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        keys, values = torch.randn(2, length, num_kv_heads, head_dim, generator=generator)
        quantized_store_kv(keys, values, cache.layers[0], slots, kv_format, k_scale, v_scale)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=generator)
    starts = torch.tensor([0, *query_lens]).cumsum(0)
    return query, cache.layers[0], torch.tensor(tables), torch.tensor(lens), starts


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 256])
def test_every_path_matches_the_widen_then_attend_reference(name, block_size):
    kv_format = FORMATS[name]
    for lens, query_lens in [([5, 37, 1], [1, 1, 1]), ([20, 9, 300], [7, 9, 33])]:
        batch = random_batch(kv_format, block_size, lens, query_lens)
        reference = quantized_paged_attention(*batch, kv_format, 0.5, 0.25, backend="torch")
        for backend in ("batched", "triton"):
            out = quantized_paged_attention(*batch, kv_format, 0.5, 0.25, backend=backend)
            torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_batched_path_reads_whole_causal_prompts_from_codes_too(name):
    kv_format = FORMATS[name]
    query, layer, tables, lens, starts = random_batch(kv_format, 16, [20, 9, 300], [20, 1, 33])
    reference = quantized_paged_attention(query, layer, tables, lens, starts, kv_format, 0.5,
                                          0.25, backend="torch")
    plan = plan_batched_attention(tables, lens, starts, 16, causal_rows=2)  # 20: whole
    assert sum(group.mask is None for group in plan.groups) == 1
    out = quantized_paged_attention(query, layer, tables, lens, starts, kv_format, 0.5, 0.25,
                                    backend="batched", plan=plan)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_scales_ride_in_the_block_so_a_block_copy_moves_them():
    kv_format = FORMATS["int8_per_token_head"]
    cache = QuantizedKVCache(1, 3, 4, 2, 8, kv_format)
    keys = torch.randn(4, 2, 8) * 5
    quantized_store_kv(keys, keys, cache.layers[0], torch.arange(4), kv_format)
    cache.layers[0][2] = cache.layers[0][0]  # what chapter 10's block copy does to a block
    widened = dequantize_layer(cache.layers[0], kv_format, 2, 8)
    assert torch.equal(widened[2], widened[0])
    assert (widened[0, 0].view(4, 2, 8) - keys).abs().max() < keys.abs().max() / 100


def test_the_codes_take_one_byte_per_number_plus_the_scales():
    for kv_format in FORMATS.values():
        cache = QuantizedKVCache(2, 10, 16, 2, 64, kv_format)
        per_slot = 2 * (64 + kv_format.scale_bytes)
        assert cache.num_bytes == 2 * 10 * 2 * 16 * per_slot


def test_bad_input_is_refused_before_anything_changes():
    for bad in ["fp8_inc", "nvfp4", "float16", None, 8]:
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            check_kv_cache_dtype(bad)
    assert check_kv_cache_dtype("fp8") is FORMATS["fp8_e4m3"] and check_kv_cache_dtype("auto") \
        is None
    for bad in [0, 0.0, -1.0, float("nan"), float("inf"), True, "1"]:
        with pytest.raises(ValueError, match="k_scale"):
            check_kv_scale("k_scale", bad)
    kv_format = FORMATS["fp8_e4m3"]
    cache = QuantizedKVCache(1, 2, 4, 2, 8, kv_format)
    before = cache.layers[0].clone()
    key = torch.ones(2, 2, 8)
    with pytest.raises(ValueError, match="k_scale"):
        quantized_store_kv(key, key, cache.layers[0], [0, 1], kv_format, k_scale=float("nan"))
    with pytest.raises(ValueError, match="slot_mapping"):
        quantized_store_kv(key, key, cache.layers[0], [0, 8], kv_format)
    fp16_layer = torch.zeros(2, 2, 4, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="uint8"):
        quantized_store_kv(key, key, fp16_layer, [0, 1], kv_format)
    with pytest.raises(ValueError, match="uint8"):
        quantized_paged_attention(torch.ones(1, 4, 8), fp16_layer, [[0]], [1], [0, 1], kv_format,
                                  backend="triton")
    assert torch.equal(cache.layers[0], before)


def greedy_tokens(engine, prompts, max_tokens=12):
    from minipaged.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(r.output_token_ids) for r in requests]


@pytest.mark.heavy
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_engine_on_each_format_agrees_across_backends_and_is_compared_with_fp32(name):
    from minipaged.engine import LLMEngine
    from minipaged.model import ModelConfig, random_model
    from minipaged.quantized import QuantizedCacheEngine, QuantizedQwen2ForCausalLM

    config = ModelConfig.small(num_layers=1)
    prompts = [list(range(1, 20)), list(range(40, 45)), list(range(7, 40))]
    reference = greedy_tokens(LLMEngine(random_model(config, seed=0), 32, 16, 128), prompts)
    answers = {}
    for backend in ("torch", "batched", "triton"):
        model = QuantizedQwen2ForCausalLM.from_model(
            random_model(config, seed=0, attention_backend=backend), name)
        answers[backend] = greedy_tokens(QuantizedCacheEngine(model, 32, 16, 128), prompts)
    assert answers["torch"] == answers["batched"] == answers["triton"]  # one format, one answer
    agreeing = sum(a == b for ours, theirs in zip(answers["torch"], reference)
                   for a, b in zip(ours, theirs))
    # Stated, not assumed: the first token comes from a prefill whose keys were just quantized,
    # so only the last-layer attention over codes separates it from the fp32 answer.
    print(f"{name}: {agreeing} of {sum(map(len, reference))} greedy tokens as fp32's")
    assert all(len(a) == 12 for a in answers["torch"])


def test_llm_takes_kv_cache_dtype_as_vllm_spells_it_and_refuses_the_rest():
    from minipaged.quantized import QuantizedKVCache as Cache
    from minipaged.quantized import QuantizedLLM

    llm = QuantizedLLM(seed=0, device="cpu", kv_cache_dtype="fp8", num_gpu_blocks_override=32,
                       max_model_len=256)
    cache = llm.llm_engine.kv_cache
    assert isinstance(cache, Cache) and cache.kv_format is FORMATS["fp8_e4m3"]
    assert llm.llm_engine.pool.num_blocks == 32  # an override is a number of blocks, kept
    by_bytes = {dtype: QuantizedLLM(seed=0, device="cpu", kv_cache_dtype=dtype,
                                    kv_cache_memory_bytes=2**20, max_model_len=256)
                for dtype in ("auto", "fp8_e5m2", "int8_per_token_head")}
    for dtype, one in by_bytes.items():
        assert one.llm_engine.kv_cache.num_bytes <= 2**20, dtype  # the same bytes, never more
    assert by_bytes["fp8_e5m2"].llm_engine.pool.num_blocks == 4 * by_bytes[
        "auto"].llm_engine.pool.num_blocks  # fp32 on a CPU: a quarter of the bytes
    for options, field in [(dict(kv_cache_dtype="nvfp4"), "kv_cache_dtype"),
                           (dict(kv_cache_dtype="fp8", preemption_mode="swap"), "kv_cache_dtype"),
                           (dict(kv_cache_dtype="fp8", parallel_sampling="fork"),
                            "kv_cache_dtype")]:
        with pytest.raises(ValueError, match=field):
            QuantizedLLM(seed=0, device="cpu", num_gpu_blocks_override=32, **options)


FP8_PROBE = '''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def cast(x_ptr, y_ptr, E4M3: tl.constexpr):
    offsets = tl.arange(0, 16)
    x = tl.load(x_ptr + offsets)
    y = x.to(tl.float8e4nv) if E4M3 else x.to(tl.float8e5)
    tl.store(y_ptr + offsets, y.to(tl.float16))

for capability in (75, 80, 89):
    for e4m3 in (True, False):
        try:
            signature = {"x_ptr": "*fp16", "y_ptr": "*fp16", "E4M3": "constexpr"}
            triton.compile(ASTSource(cast, signature, {"E4M3": e4m3}, {}),
                           target=GPUTarget("cuda", capability, 32))
            print(capability, e4m3, "compiles")
        except Exception:
            print(capability, e4m3, "refused")
'''


@pytest.mark.heavy
def test_triton_has_no_e4m3_type_below_8_9_which_is_why_the_kernels_use_integer_moves(
        tmp_path):
    import os
    import subprocess
    import sys

    probe = tmp_path / "probe.py"  # @triton.jit wants its source in a file
    probe.write_text(FP8_PROBE)
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env,
                         timeout=600)
    if run.returncode:
        pytest.skip(f"triton cannot compile for CUDA here: {run.stderr[-300:]}")
    lines = set(run.stdout.split("\n"))
    assert {"75 True refused", "80 True refused", "89 True compiles"} <= lines, run.stdout


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_chapter_10s_block_copy_and_chapter_11s_swap_move_codes_and_scales_together(name):
    from minipaged.sharing import copy_blocks
    from minipaged.swap import HostKVCache

    kv_format = FORMATS[name]
    cache = QuantizedKVCache(2, 6, 4, 2, 8, kv_format)
    keys = torch.randn(8, 2, 8) * 3
    for layer in cache.layers:
        quantized_store_kv(keys, -keys, layer, torch.arange(8), kv_format, 0.5, 0.5)
    before = [dequantize_layer(layer, kv_format, 2, 8, 0.5, 0.5)[:2] for layer in cache.layers]
    copy_blocks(cache, [0, 1], [2, 3])  # chapter 10's Triton copy, under the interpreter here
    host = HostKVCache(4, 4)
    host.swap_out_blocks(cache, [(2, 0), (3, 1)])
    for layer in cache.layers:
        layer[2:4] = 0  # the device blocks are reused by someone else meanwhile
    host.swap_in_blocks(cache, [(0, 4), (1, 5)])
    for layer, want in zip(cache.layers, before):
        assert torch.equal(dequantize_layer(layer, kv_format, 2, 8, 0.5, 0.5)[4:6], want)


def test_the_package_llm_is_chapter_14s_and_takes_kv_cache_dtype():
    """`from minipaged import LLM` is the last chapter's front end, as vLLM has one LLM with
    every option: kv_cache_dtype checked by name, "auto" being chapter 12's LLM unchanged."""
    import minipaged
    from minipaged.quantized import QuantizedLLM

    assert minipaged.LLM is QuantizedLLM and "LLM" in minipaged.__all__
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        minipaged.LLM(kv_cache_dtype="nvfp4")


def test_the_step_cost_prices_the_cache_reads_at_the_formats_bytes():
    """Chapter 13's StepCost less the bytes an 8-bit cache does not read: for fp8 half the
    fp16 reads, for int8 (D + 4) / 2D of them; None is chapter 13's cost unchanged."""
    from minipaged.blocks import BlockPool
    from minipaged.memory import QWEN2_5_0_5B
    from minipaged.quantized import QuantizedStepCost
    from minipaged.reckoning import decode_step_bytes
    from minipaged.sampling import SamplingParams
    from minipaged.scheduler import KVCacheManager, Request, Scheduler
    from minipaged.serving import StepCost

    scheduler = Scheduler(KVCacheManager(BlockPool(64, 16)), max_model_len=512)
    for name, prompt in [("a", 30), ("b", 70)]:
        scheduler.add_request(Request(name, [0] * prompt, SamplingParams()))
    out = scheduler.schedule()
    fp16 = StepCost(QWEN2_5_0_5B)(out)
    assert QuantizedStepCost(QWEN2_5_0_5B)(out) == fp16
    reads = decode_step_bytes(QWEN2_5_0_5B, 1, 100)["keys and values"] / 320e9
    assert QuantizedStepCost(QWEN2_5_0_5B, kv_format=FORMATS["fp8_e4m3"])(out) == pytest.approx(
        fp16 - reads / 2)
    int8 = QuantizedStepCost(QWEN2_5_0_5B, kv_format=FORMATS["int8_per_token_head"])(out)
    assert int8 == pytest.approx(fp16 - reads * (1 - 68 / 128))
    with pytest.raises(ValueError, match="kv_format"):
        QuantizedStepCost(QWEN2_5_0_5B, kv_format="fp8")
