"""The engine end to end: greedy answers equal transformers' in every regime, bad input refused."""
import inspect
import math
import os
import re
import reprlib
import subprocess
import sys

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import minipaged.engine
import minipaged.kernels
import minipaged.scheduler
import minipaged.sizing
from minipaged import LLM, SamplingParams
from minipaged.bad_inputs import BAD_GENERATE_ARGUMENTS, BAD_LLM_OPTIONS
from minipaged.frontend import FrontEndArgs
from minipaged.huggingface import save_pretrained, to_transformers
from minipaged.model import ModelConfig, random_model

MAX_TOKENS = 12
LENGTHS = [3, 9, 17, 33, 5, 24]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=2), seed=0)


@pytest.fixture(scope="module")
def prompts(model):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist()
            for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(model, prompts):
    peer = to_transformers(model)
    return [peer.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
REGIMES = {"ample": {}, "chunked": dict(max_num_batched_tokens=7),
           "starved": dict(num_gpu_blocks_override=6, max_model_len=64)}


@pytest.mark.heavy
@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_matches_transformers(model, prompts, expected, regime):
    llm = LLM(model=model, **REGIMES[regime])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.prompt_token_ids for o in outputs] == prompts  # input order
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.llm_engine.stats()
    if regime == "starved":
        assert stats["num_preemptions"] > 0
    if regime == "chunked":
        assert stats["num_steps"] > MAX_TOKENS + sum(LENGTHS) // 7
    assert llm.llm_engine.pool.get_num_free_blocks() == llm.llm_engine.pool.num_blocks


@pytest.mark.heavy
def test_local_hugging_face_directory(model, prompts, expected, tmp_path):
    save_pretrained(model, tmp_path / "checkpoint")
    llm = LLM(model=str(tmp_path / "checkpoint"), dtype=torch.float32, device="cpu")
    assert llm.get_tokenizer() is None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected[:2]


@pytest.mark.heavy
def test_triton_interpreter_gives_the_torch_tokens(model, prompts):
    triton_model = random_model(model.config, seed=0, attention_backend="triton")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    few = [{"prompt_token_ids": p} for p in prompts[:2]]
    torch_out = LLM(model=model, max_model_len=128).generate(few, params, use_tqdm=False)
    triton_out = LLM(model=triton_model, max_model_len=128).generate(few, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in torch_out] == [
        o.outputs[0].token_ids for o in triton_out]


@pytest.mark.heavy
def test_the_batched_cpu_path_gives_the_reference_tokens(model, prompts):
    """auto on a CPU is chapter 5's batched path; with a small budget every step mixes chunks
    of prompts with decodes, and the tokens are those of chapter 4's reference attention."""
    assert minipaged.kernels.resolve_backend(model.attention_backend,
                                             next(model.parameters())) == "batched"
    reference = random_model(model.config, seed=0, attention_backend="torch")
    batch = [{"prompt_token_ids": p} for p in prompts]
    outputs = {name: LLM(model=m, max_model_len=128, max_num_batched_tokens=16).generate(
        batch, GREEDY, use_tqdm=False) for name, m in (("batched", model), ("torch", reference))}
    assert [o.outputs[0].token_ids for o in outputs["batched"]] == [
        o.outputs[0].token_ids for o in outputs["torch"]]


def test_the_metadata_the_engine_builds_unchecked_passes_every_check(model, prompts):
    """The engine builds each step's metadata and runs the model with validate=False; on every
    step of a chunked, starved and prefix-cached run, chapter 6's checks accept what it built,
    and the checked builder gives the same tensors."""
    from minipaged.model import _check_inputs, prepare_metadata
    for regime in ("chunked", "starved"):
        engine = LLM(model=model, **({"max_model_len": 64} | REGIMES[regime])).llm_engine
        for i, prompt in enumerate(prompts + prompts[:2]):  # the repeats hit the prefix cache
            engine.add_request(str(i), prompt, GREEDY)
        while engine.has_unfinished_requests():
            out = engine.scheduler.schedule()
            input_ids, metadata = engine.prepare_inputs(out)
            _check_inputs(model.config, input_ids, metadata, engine.kv_cache)
            manager, requests = engine.scheduler.kv_cache_manager, out.scheduled_requests
            checked = prepare_metadata(
                [manager.get_block_table(r).block_ids for r in requests],
                [r.num_computed_tokens for r in requests],
                [out.num_scheduled_tokens[r.request_id] for r in requests],
                engine.pool.block_size)
            for name in ("positions", "slot_mapping", "block_tables", "seq_lens",
                         "query_start_loc"):
                assert torch.equal(getattr(checked, name), getattr(metadata, name)), name
            engine.execute(out)
    assert engine.stats()["num_preemptions"] > 0  # the starved run preempted


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_seeded_sampling_survives_preemption(model, prompts):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    batch = [{"prompt_token_ids": p} for p in prompts]
    ample = LLM(model=model, max_model_len=128).generate(batch, params, use_tqdm=False)
    starved_llm = LLM(model=model, **REGIMES["starved"])
    starved = starved_llm.generate(batch, params, use_tqdm=False)
    assert starved_llm.llm_engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in ample] == [o.outputs[0].token_ids for o in starved]


def test_stream_yields_each_token_once(model, prompts):
    llm = LLM(model=model, max_model_len=128)
    batch = [{"prompt_token_ids": p} for p in prompts[:3]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    pieces = {}
    for out in llm.stream(batch, params):
        assert len(out.outputs[0].token_ids) == 1
        pieces.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    whole = llm.generate(batch, params, use_tqdm=False)
    assert list(pieces.values()) == [o.outputs[0].token_ids for o in whole]


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_abandoned_stream_frees_its_blocks(model, prompts):
    llm = LLM(model=model, max_model_len=128)
    stream = llm.stream({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=50))
    next(stream)
    stream.close()
    pool = llm.llm_engine.pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.heavy  # a second: decodes a few hundred steps
def test_allocator_called_once_per_block_in_decode(model):
    llm = LLM(model=model, max_model_len=512)
    llm.generate({"prompt_token_ids": list(range(9))},
                 SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_steps"] == 100
    assert stats["num_allocator_calls"] == -(-(9 + 100 - 1) // 16)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_metrics_and_counters(model):
    llm = LLM(model=model, **REGIMES["starved"])
    outputs = llm.generate([{"prompt_token_ids": [1] * 30}] * 4,
                           SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert all(o.metrics.time_to_first_token >= 0 for o in outputs)
    assert sum(o.metrics.num_preemptions for o in outputs) == llm.llm_engine.stats()[
        "num_preemptions"] > 0
    assert all(o.metrics.num_generation_tokens == 20 for o in outputs)


BAD_PROMPTS = {
    "max_model_len": {"prompt_token_ids": [1] * 65},
    "empty": {"prompt_token_ids": []},
    "vocabulary": {"prompt_token_ids": [1, 10**6]},
    "tokenizer": "a string prompt",
    "prompt_token_ids": {"prompt_token_ids": ["a", "b"]},
}


@pytest.mark.parametrize("problem", BAD_PROMPTS)
def test_bad_prompt_is_refused_and_nothing_admitted_is_lost(model, problem):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)
    engine = llm.llm_engine
    kept = engine.add_request("kept", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    good = {"prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match=problem):
        llm.generate([good, BAD_PROMPTS[problem]], use_tqdm=False)
    assert list(engine.requests) == ["kept"]  # the good prompt beside the bad one was not queued
    while engine.has_unfinished_requests():
        engine.step()
    assert kept.num_output_tokens == 4 and kept.status.finish_reason == "length"


@pytest.mark.parametrize("options, field", [
    (dict(num_gpu_blocks_override=8), "num_gpu_blocks"),
    (dict(block_size=48), "block_size"),
    (dict(block_size=512), "block_size"),
    (dict(max_model_len=4096), "max_model_len"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching"),
])
def test_bad_engine_options_name_the_field(model, options, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=model, **options)


@pytest.mark.parametrize("num_gpu_blocks", [10**13, 10**30])
def test_a_pool_too_large_to_allocate_is_refused_before_any_block_exists(model, num_gpu_blocks):
    # 10**13 blocks are petabytes (the allocator refuses); 10**30 is past int64 (torch refuses
    # the size). Either way the refusal names the option, at once: the pool, whose blocks are
    # Python objects, is built only after the cache's tensors exist.
    with pytest.raises(ValueError, match=f"num_gpu_blocks={num_gpu_blocks} "):
        minipaged.engine.LLMEngine(model, num_gpu_blocks)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_prefix_caching_is_on_by_default_as_in_vllm(model):
    from minipaged.llm import KV_CACHE_MANAGER_CLASSES
    from minipaged.prefix_cache import PrefixCachingKVCacheManager

    assert KV_CACHE_MANAGER_CLASSES[False, "split", False] is minipaged.scheduler.KVCacheManager
    assert KV_CACHE_MANAGER_CLASSES[True, "split", False] is PrefixCachingKVCacheManager
    assert type(LLM(model=model).llm_engine.scheduler.kv_cache_manager) is (
        PrefixCachingKVCacheManager)
    plain = LLM(model=model, enable_prefix_caching=False).llm_engine.scheduler.kv_cache_manager
    assert type(plain) is minipaged.scheduler.KVCacheManager


def test_sampling_params_list_must_match(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": [1]}] * 2, [SamplingParams()] * 3, use_tqdm=False)


def test_random_preset_and_cpu_budget():
    llm = LLM(model="random", max_model_len=256, seed=3)
    pool = llm.llm_engine.pool
    per_token = llm.model.config.model_shape(4).kv_bytes_per_token
    assert pool.num_blocks == min(256 * (256 // 16), 256 * 2**20 // (per_token * 16))
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3),
                       use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 3


def test_stop_reason_names_the_stop_token_but_not_eos(model, prompts):
    prompt = {"prompt_token_ids": prompts[0]}
    greedy = SamplingParams(temperature=0, max_tokens=4)
    first = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8).generate(
        prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert (first.finish_reason, first.stop_reason) == ("length", None)
    token = first.token_ids[0]
    stopped = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8).generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[token]),
        use_tqdm=False)[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason, stopped.stop_reason) == (
        [token], "stop", token)
    with_eos = random_model(ModelConfig.small(num_layers=2, eos_token_id=token), seed=0)
    at_eos = LLM(model=with_eos, max_model_len=64, num_gpu_blocks_override=8).generate(
        prompt, greedy, use_tqdm=False)[0].outputs[0]
    assert (at_eos.token_ids, at_eos.finish_reason, at_eos.stop_reason) == ([token], "stop", None)


@pytest.mark.parametrize("module", [minipaged.scheduler, minipaged.engine])
def test_methods_attached_after_the_fact_are_not_public_functions(module):
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and c.__module__ == module.__name__]
    methods = {id(f) for c in classes for f in vars(c).values() if inspect.isfunction(f)}
    public = [name for name, value in vars(module).items()
              if not name.startswith("_") and inspect.isfunction(value) and id(value) in methods]
    assert public == []
    # add_to_class leaves None where a method was written: nothing callable but the method
    assert getattr(module, "generate", None) is None and getattr(module, "schedule", None) is None


@pytest.mark.heavy  # a subprocess or a scratch repository: seconds
def test_unseeded_sampling_is_reproducible_across_processes():
    # LLM(seed=...) must give the same samples in a new process, whatever Python's hash seed.
    script = ("from minipaged import LLM, SamplingParams; llm = LLM(model='random', seed=3); "
              "out = llm.generate({'prompt_token_ids': [1, 2, 3]}, "
              "SamplingParams(max_tokens=6, temperature=1.0), use_tqdm=False); "
              "print(out[0].outputs[0].token_ids)")
    answers = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, check=True)
        answers.add(result.stdout.strip().splitlines()[-1])
    assert len(answers) == 1


# ------------------------------------------------ bad input leaves the engine as it was


def engine_state(llm):
    """Everything a refused input must leave unchanged."""
    engine = llm.llm_engine
    return (engine.pool.get_num_free_blocks(), [r.request_id for r in engine.scheduler.waiting],
            [r.request_id for r in engine.scheduler.running], sorted(engine.requests),
            llm._next_id, dict(llm._inboxes))


def assert_consistent(engine):
    """One source of truth: the engine's live requests are exactly those the scheduler holds."""
    queued = [r.request_id for r in engine.scheduler.waiting] + [
        r.request_id for r in engine.scheduler.running]
    assert sorted(queued) == sorted(engine.requests)
    assert not any(r.status.finished for r in engine.requests.values())
    tables = engine.scheduler.kv_cache_manager.block_tables.values()
    held = {id(block) for table in tables for block in table.blocks}  # shared blocks count once
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks - len(held)


@pytest.fixture
def guarded(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)
    llm.llm_engine.add_request("kept", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    return llm


def finish_kept(llm, model):
    engine = llm.llm_engine
    kept = engine.requests["kept"]
    while engine.has_unfinished_requests():
        engine.step()
    fresh = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8).generate(
        {"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=4),
        use_tqdm=False)
    assert kept.output_token_ids == fresh[0].outputs[0].token_ids
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks and not engine.requests


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("field, arguments", BAD_GENERATE_ARGUMENTS,
                         ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_GENERATE_ARGUMENTS)])
def test_catalogued_bad_arguments_are_refused_by_generate_and_stream_changing_nothing(
        model, guarded, field, arguments):
    before = engine_state(guarded)
    with pytest.raises(ValueError, match=re.escape(field)):
        guarded.generate(**arguments, use_tqdm=False)
    with pytest.raises(ValueError, match=re.escape(field)):
        next(guarded.stream(**arguments))
    assert engine_state(guarded) == before
    finish_kept(guarded, model)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("option, value", BAD_LLM_OPTIONS,
                         ids=[f"{o}={reprlib.repr(v)}" for o, v in BAD_LLM_OPTIONS])
def test_catalogued_bad_options_are_refused_naming_the_option(model, guarded, option, value):
    before = engine_state(guarded)
    with pytest.raises(ValueError, match=rf"\b{option}\b"):
        LLM(model=model, **{option: value})
    assert engine_state(guarded) == before
    finish_kept(guarded, model)


# The package's LLM (minipaged/llm.py) adds vLLM's options for the later chapters' parts.
BAD_SERVING_OPTIONS = [
    ("enable_prefix_caching", "yes"), ("enable_prefix_caching", 0),
    ("swap_space", -1), ("swap_space", "4"), ("swap_space", float("inf")),
    ("preemption_mode", "page-out"), ("preemption_mode", None),
    ("parallel_sampling", "clone"), ("parallel_sampling", 2),
    ("prefix_match_unit", 3), ("prefix_match_unit", 0), ("prefix_match_unit", 32),
    ("prefix_match_unit", 4.0),
]


@pytest.mark.parametrize("option, value", BAD_SERVING_OPTIONS,
                         ids=[f"{o}={reprlib.repr(v)}" for o, v in BAD_SERVING_OPTIONS])
def test_bad_vllm_options_of_the_package_llm_are_refused_naming_the_option(model, option, value):
    with pytest.raises(ValueError, match=rf"\b{option}\b"):
        LLM(model=model, **{option: value})


def test_chapter_7s_front_end_takes_classes_and_the_package_llm_chooses_them(model):
    from minipaged.frontend import LLMFrontEnd
    from minipaged.prefix_cache import PrefixCachingKVCacheManager

    plain = LLMFrontEnd(model=model, num_gpu_blocks_override=64, max_model_len=128)
    assert type(plain.llm_engine.scheduler.kv_cache_manager) is minipaged.scheduler.KVCacheManager
    cached = LLMFrontEnd(model=model, num_gpu_blocks_override=64, max_model_len=128,
                         kv_cache_manager_cls=PrefixCachingKVCacheManager)
    assert type(cached.llm_engine.scheduler.kv_cache_manager) is PrefixCachingKVCacheManager
    with pytest.raises(ValueError, match="enable_prefix_caching"):  # not chapter 7's option
        LLMFrontEnd(model=model, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="FrontEndArgs has no option 'enable_prefix_cach"):
        LLMFrontEnd(model=model, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_cache_manager_cls is chosen.*LLMFrontEnd"):
        LLM(model=model, kv_cache_manager_cls=PrefixCachingKVCacheManager)
    with pytest.raises(ValueError, match="EngineArgs has no option 'no_such'"):
        LLM(model=model, no_such=1)


def test_zero_is_not_the_default():
    with pytest.raises(ValueError, match="num_gpu_blocks_override must be an integer >= 1"):
        LLM(model="random", num_gpu_blocks_override=0)
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
        LLM(model="random", max_model_len=0)


def test_cache_size_errors_name_the_option_and_the_bytes(model):
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1,024 gives 0 blocks .* needs "
                                         r"8 blocks \(262,144 bytes\)"):
        LLM(model=model, kv_cache_memory_bytes=1024, max_model_len=128)
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=10000000000 gives "
                                         r"10,000,000,000 blocks, a cache of 327,680,000,000,000 "
                                         r"bytes, but cpu has [\d,]+ bytes free"):
        LLM(model=model, num_gpu_blocks_override=10**10, device="cpu")
    llm = LLM(model=model, kv_cache_memory_bytes=8 * 32_768, max_model_len=128)
    assert llm.llm_engine.pool.num_blocks == 8  # exactly enough is enough


class Tokenizer:
    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_a_tokenizer_needs_encode_and_decode(model):
    llm = LLM(model=model, tokenizer=Tokenizer(), max_model_len=64)
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_token_ids == [4, 5] and out.outputs[0].text == " ".join(
        map(str, out.outputs[0].token_ids))
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(model=model, tokenizer=type("OnlyEncode", (), {"encode": lambda self, t: [1]})())


INVALID_OPTIONS = {
    "seed": st.one_of(st.none(), st.booleans(), st.integers(max_value=-1),
                      st.integers(2**63, 2**80), st.floats(), st.text(max_size=3)),
    "num_gpu_blocks_override": st.one_of(st.booleans(), st.integers(max_value=0),
                                         st.integers(1, 127),  # 2048 tokens need 128 blocks
                                         st.integers(10**10, 10**15), st.floats(),
                                         st.text(max_size=3), st.lists(st.integers(), max_size=2)),
    "kv_cache_memory_bytes": st.one_of(st.booleans(), st.integers(max_value=0),
                                       st.integers(1, 128 * 32_768 - 1), st.integers(2**50, 2**70),
                                       st.floats(), st.text(max_size=3)),
    "max_model_len": st.one_of(st.booleans(), st.integers(max_value=0), st.integers(2049, 10**9),
                               st.floats(), st.text(max_size=3)),
    "max_num_seqs": st.one_of(st.none(), st.booleans(), st.integers(max_value=0), st.floats(),
                              st.text(max_size=3)),
    "max_num_batched_tokens": st.one_of(st.none(), st.booleans(), st.integers(max_value=0),
                                        st.floats(), st.text(max_size=3)),
    "gpu_memory_utilization": st.one_of(
        st.none(), st.booleans(), st.floats().filter(lambda u: not 0 < u <= 1),
        st.integers().filter(lambda u: not 0 < u <= 1), st.text(max_size=3)),
    "block_size": st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.integers().filter(
        lambda b: b < 1 or b > 256 or b & (b - 1))),
    "device": st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=8).filter(
        lambda d: not d.strip().lower().startswith(("cpu", "cuda")))),
    "dtype": st.one_of(st.integers(), st.text(max_size=8).filter(
        lambda d: d not in ("auto", "float16", "bfloat16", "float32")),
        st.sampled_from([torch.int32, torch.float64, torch.bool, torch.complex64])),
    "tokenizer": st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.booleans(),
                           st.lists(st.integers(), max_size=2)),
    "enable_prefix_caching": st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=3)),
    "attention_backend": st.one_of(st.none(), st.integers(), st.text(max_size=8).filter(
        lambda b: b not in ("auto", "torch", "batched", "triton"))),
}


@pytest.fixture(scope="module")
def hypothesis_llm(model):
    return LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
@settings(max_examples=150, deadline=None)
@given(data=st.data(), option=st.sampled_from(sorted(INVALID_OPTIONS)))
def test_any_bad_option_is_refused_by_name_and_the_engine_is_untouched(
        model, hypothesis_llm, data, option):
    value = data.draw(INVALID_OPTIONS[option], label=option)
    engine = hypothesis_llm.llm_engine
    if not engine.requests:
        engine.add_request(f"kept-{engine.num_steps}", [4, 5, 6],
                           SamplingParams(temperature=0, max_tokens=4))
    before = engine_state(hypothesis_llm)
    with pytest.raises(ValueError, match=rf"\b{option}\b"):
        LLM(model=model, **{option: value})
    assert engine_state(hypothesis_llm) == before
    engine.step()  # the next good call still works, and keeps the books straight
    assert_consistent(engine)


# ---------------------------------------------------------------- exceptions, streams, aborts


class FailingModel:
    """Stands in for the engine's model: the call numbered fail_at raises, or runs a hook."""

    def __init__(self, inner, fail_at, error=None, hook=None):
        self.inner, self.fail_at, self.error, self.hook, self.calls = inner, fail_at, error, hook, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.hook is not None:
                self.hook()
            if self.error is not None:
                raise self.error
        return self.inner(*args, **kwargs)


THREE = [{"prompt_token_ids": p} for p in ([1, 2, 3], [4, 5, 6, 7], [8, 9])]
TEN_TOKENS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("error", [RuntimeError("the forward pass failed"), KeyboardInterrupt()])
def test_generate_withdraws_its_requests_on_any_exception(model, error):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    engine.model = FailingModel(model, fail_at=3, error=error)
    with pytest.raises(type(error)):
        llm.generate(THREE, TEN_TOKENS, use_tqdm=False)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks
    steps = engine.num_steps
    again = llm.generate(THREE, TEN_TOKENS, use_tqdm=False)  # the model works again
    fresh = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    expected = fresh.generate(THREE, TEN_TOKENS, use_tqdm=False)
    assert engine.num_steps - steps == fresh.llm_engine.num_steps  # nothing left behind to run
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_a_stream_withdraws_its_requests_when_a_step_fails(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    engine.model = FailingModel(model, fail_at=4, error=KeyboardInterrupt())
    stream = llm.stream(THREE, TEN_TOKENS)
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    assert not engine.requests and not llm._inboxes
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks


def solo_answers(model, prompts, params):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def collect(outputs):
    joined = {}
    for out in outputs:
        joined.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    return list(joined.values())


def test_two_streams_read_in_turns_each_get_all_their_tokens(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    p, q = THREE[0], THREE[1]
    g = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    pairs = list(zip(llm.stream(p, g), llm.stream(q, g)))
    assert len(pairs) == 3
    assert [a.outputs[0].token_ids[0] for a, _ in pairs] == solo_answers(model, [p], g)[0]
    assert [b.outputs[0].token_ids[0] for _, b in pairs] == solo_answers(model, [q], g)[0]
    assert [a.finished for a, _ in pairs] == [False, False, True]
    engine = llm.llm_engine
    assert not engine.requests and not llm._inboxes
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks


@settings(max_examples=25, deadline=None)
@given(order=st.lists(st.integers(0, 2), min_size=1, max_size=60),
       lengths=st.lists(st.integers(1, 6), min_size=3, max_size=3))
@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_streams_read_in_any_order_beside_generate_each_get_their_own_tokens(
        model, order, lengths):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=6)  # preempts too
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    streams = [llm.stream(THREE[i], params[i]) for i in range(3)]
    got = [[] for _ in streams]
    for turn, i in enumerate(order):
        out = next(streams[i], None)
        if out is not None:
            got[i].append(out)
        if turn == 5:  # a generate in the middle steps the engine for everyone
            solo = llm.generate(THREE[2], params[2], use_tqdm=False)[0].outputs[0].token_ids
            assert solo == solo_answers(model, [THREE[2]], params[2])[0]
        assert_consistent(llm.llm_engine)
    for i, stream in enumerate(streams):
        got[i].extend(stream)  # read each to its end
        assert collect(got[i]) == solo_answers(model, [THREE[i]], params[i])
        assert got[i][-1].finished and not any(o.finished for o in got[i][:-1])
    engine = llm.llm_engine
    assert not engine.requests and not llm._inboxes
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks


def test_abort_request_withdraws_by_id_and_keeps_one_list_of_live_requests(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    for name, prompt in [("a", [1, 2, 3]), ("b", [4, 5]), ("c", [6] * 20)]:
        engine.add_request(name, prompt, TEN_TOKENS)
    engine.step()
    engine.add_request("d", [7, 8], TEN_TOKENS)  # still waiting
    requests = dict(engine.requests)
    engine.abort_request("b")
    engine.abort_request(["d", "never-there"])  # unknown ids are passed over
    engine.abort_request("b")  # and so are finished ones
    assert sorted(engine.requests) == ["a", "c"]
    assert_consistent(engine)
    assert requests["b"].status.finish_reason == requests["d"].status.finish_reason == "abort"
    for bad in (3, None, [1, "a"], b"a"):
        with pytest.raises(ValueError, match="request_id"):
            engine.abort_request(bad)
    with pytest.raises(ValueError, match="request_id must be a string"):
        engine.add_request(5, [1, 2], TEN_TOKENS)  # an id abort_request could not name
    assert sorted(engine.requests) == ["a", "c"]
    while engine.has_unfinished_requests():
        engine.step()
        assert_consistent(engine)
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks and not engine.requests


def test_a_request_aborted_from_outside_ends_its_stream_and_its_generate(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    stream = llm.stream(THREE[:2], TEN_TOKENS)
    first = next(stream)
    engine.abort_request(first.request_id)
    rest = list(stream)
    mine = [o for o in rest if o.request_id == first.request_id]
    assert len(mine) == 1 and mine[0].outputs[0].finish_reason == "abort"
    assert mine[0].outputs[0].token_ids == []
    step = engine.step
    engine.step = FailingModel(step, fail_at=3, hook=lambda: engine.abort_request(
        sorted(engine.requests)[0]))  # between two steps of generate
    outputs = llm.generate(THREE, TEN_TOKENS, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort", "length", "length"]
    assert not engine.requests and engine.pool.get_num_free_blocks() == engine.pool.num_blocks


def test_a_refused_request_never_stays_in_the_engine(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=10)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="top_k"):
        llm.generate(THREE, [SamplingParams(), SamplingParams(), SamplingParams(top_k=True)])
    assert not engine.requests
    good = llm.generate(THREE, TEN_TOKENS, use_tqdm=False)  # and later calls are not affected
    assert all(len(o.outputs[0].token_ids) == 10 for o in good)


# ---------------------------------------------------------------- a randomized engine, starved


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_random_workloads_oversubscribed_give_the_ample_answers_and_free_the_pool(model, data):
    draw = data.draw
    num_requests = draw(st.integers(4, 12), label="requests")
    vocab = model.config.vocab_size
    prompts = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=24))
               for _ in range(num_requests)]
    params = [SamplingParams(temperature=draw(st.sampled_from([0, 0.8])), top_p=0.9, seed=i,
                             max_tokens=draw(st.integers(1, 16)), ignore_eos=True)
              for i in range(num_requests)]
    block_size = draw(st.sampled_from([4, 8, 16]), label="block_size")
    lengths = [len(p) + s.max_tokens for p, s in zip(prompts, params)]
    max_model_len = max(lengths)
    wanted = sum(-(-n // block_size) for n in lengths)
    target = draw(st.floats(2.5, 10.0), label="oversubscription")
    num_blocks = max(-(-max_model_len // block_size), math.floor(wanted / target))
    assume(2.5 <= wanted / num_blocks <= 10)
    options = dict(block_size=block_size, max_model_len=max_model_len)
    batch = [{"prompt_token_ids": p} for p in prompts]
    ample = LLM(model=model, enable_prefix_caching=False, **options).generate(
        batch, params, use_tqdm=False)
    starved = LLM(model=model, num_gpu_blocks_override=num_blocks,
                  enable_prefix_caching=draw(st.booleans(), label="prefix caching"),
                  max_num_batched_tokens=draw(st.integers(1, 16), label="token budget"),
                  max_num_seqs=draw(st.integers(1, 8), label="max_num_seqs"), **options)
    engine = starved.llm_engine
    step = engine.step

    def checked_step():
        finished = step()
        assert_consistent(engine)
        return finished

    engine.step = checked_step
    answers = starved.generate(batch, params, use_tqdm=False)
    event(f"preempted: {engine.stats()['num_preemptions'] > 0}")
    assert [o.outputs[0].token_ids for o in answers] == [o.outputs[0].token_ids for o in ample]
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks and not engine.requests


# ---- the cache's size: what the workload can use on a CPU, a clear refusal on a full GPU ----

@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_cpu_default_cache_holds_what_the_workload_can_use_and_says_so(model, caplog):
    per_block = model.config.model_shape(4).kv_bytes_per_token * 16
    with caplog.at_level("INFO", logger="minipaged"):
        llm = LLM(model=model, max_model_len=64, max_num_seqs=3, enable_prefix_caching=False)
    assert llm.llm_engine.pool.num_blocks == 3 * 4  # 3 sequences of 4 blocks, not 256 MiB
    assert llm.llm_engine.kv_cache.num_bytes == 12 * per_block
    assert "max_num_seqs x max_model_len" in llm.cache_size_source
    assert f"12 blocks of 16 tokens, {12 * per_block:,} bytes reserved" in caplog.text
    capped = LLM(model=model, max_num_seqs=10**6, enable_prefix_caching=False)
    assert capped.llm_engine.pool.num_blocks == minipaged.sizing.CPU_KV_CACHE_BYTES // per_block
    asked = LLM(model=model, max_num_seqs=3, kv_cache_memory_bytes=200 * per_block)
    assert asked.llm_engine.pool.num_blocks == 200  # a size asked for is a size given


@pytest.fixture
def simulated_gpu(monkeypatch):
    """The CPU seen as a GPU of 16 GiB with `free` bytes free (set free[0]), as mem_get_info
    would report it, whose forward pass peaks at 300 MiB: LLM sizes its cache as on a card."""
    free = [16 * 2**30]
    monkeypatch.setattr(minipaged.sizing, "device_memory", lambda device: (free[0], 16 * 2**30))
    monkeypatch.setattr(minipaged.sizing, "peak_forward_bytes", lambda run, device: 300 * 2**20)
    return free


def test_gpu_budget_is_utilization_minus_what_is_used_and_the_forward_peak(model, simulated_gpu):
    total, simulated_gpu[0] = 16 * 2**30, 10 * 2**30  # 6 GiB held by others
    per_block = model.config.model_shape(4).kv_bytes_per_token * 16
    utilization = (6 * 2**30 + 300 * 2**20 + 1000 * per_block) / total  # about 1,000 blocks left
    llm = LLM(model=model, gpu_memory_utilization=utilization, enable_prefix_caching=False)
    blocks = llm.llm_engine.pool.num_blocks
    assert llm.cache_size_source == "gpu_memory_utilization (after profiling)"
    assert blocks == (int(utilization * total) - 6 * 2**30 - 300 * 2**20) // per_block
    assert blocks in (999, 1000)  # chapter 1's budget: utilization x total - used - activations


def test_a_budget_the_card_cannot_give_is_refused_before_any_cache(model, simulated_gpu):
    simulated_gpu[0] = 4 * 2**30  # 12 of 16 GiB in use: 0.7 of the card leaves nothing
    with pytest.raises(ValueError, match=r"No available memory for the cache blocks: "
                                         r"gpu_memory_utilization=0.7 of the device's 16.00 GiB "
                                         r"is 11.20 GiB, but 12.00 GiB is in use already"):
        LLM(model=model, gpu_memory_utilization=0.7)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=5,368,709,120 gives 163,840 "
                                         r"blocks, a cache of 5,368,709,120 bytes, but cpu has "
                                         r"4,294,967,296 bytes free"):
        LLM(model=model, kv_cache_memory_bytes=5 * 2**30)
    simulated_gpu[0] = 16 * 2**30 - 100 * 2**20  # 2 MiB left over: less than one sequence
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(after profiling\) gives "
                                         r"64 blocks .* max_model_len=2048 needs 128 blocks"):
        LLM(model=model, gpu_memory_utilization=402 * 2**20 / (16 * 2**30))


def test_profiling_out_of_memory_is_a_clear_refusal(model, simulated_gpu, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(minipaged.sizing, "peak_forward_bytes", out_of_memory)
    with pytest.raises(ValueError, match="No available memory to profile a forward pass of "
                       f"max_num_batched_tokens={FrontEndArgs.max_num_batched_tokens}"):
        LLM(model=model)


@pytest.mark.heavy  # Triton's interpreter runs every layer's kernels: seconds
def test_host_reads_per_step_do_not_grow_with_the_layers(monkeypatch):
    """A step checks its metadata once, on the host; no layer reads a tensor back (a sync on a
    GPU). The engine's own reads of tensors are counted for 2 and 6 layers: the same."""
    package = os.path.dirname(minipaged.engine.__file__)
    counts = []
    for num_layers in (2, 6):
        model = random_model(ModelConfig.small(num_layers=num_layers), seed=0,
                             attention_backend="triton")
        llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=16,
                  enable_prefix_caching=False)
        reads = []
        with monkeypatch.context() as patch:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                         "__index__"):
                original = getattr(torch.Tensor, name)

                def counted(tensor, *args, _original=original, _reads=reads, **kwargs):
                    caller = sys._getframe(1).f_code.co_filename
                    if caller.startswith(package):  # minipaged's reads, not the interpreter's
                        _reads.append(caller)
                    return _original(tensor, *args, **kwargs)
                patch.setattr(torch.Tensor, name, counted)
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8]}],
                         SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
        counts.append((len(reads), llm.llm_engine.num_steps))
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 40 * counts[0][1]  # a few dozen checks a step, not per layer


def test_host_memory_without_proc_meminfo_falls_back_to_the_physical_memory(monkeypatch):
    import builtins
    import os

    import minipaged.engine

    real_open = builtins.open

    def no_meminfo(path, *args, **kwargs):
        if path == "/proc/meminfo":
            raise OSError("no /proc here")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    monkeypatch.setattr(os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 1000}.__getitem__)
    assert minipaged.sizing.free_memory_bytes(torch.device("cpu")) == 4096 * 1000
    monkeypatch.delattr(os, "sysconf")  # Windows: neither can be told
    assert minipaged.sizing.free_memory_bytes(torch.device("cpu")) is None


# ---------------------------------------------------------------- issue 26's small items


def test_two_ways_of_sizing_the_cache_together_are_refused_by_name(model, guarded):
    before = engine_state(guarded)
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=8 and "
                                         r"kv_cache_memory_bytes=\d+ both size the cache"):
        LLM(model=model, num_gpu_blocks_override=8, kv_cache_memory_bytes=2**20)
    assert engine_state(guarded) == before
    finish_kept(guarded, model)


def test_a_step_with_nothing_to_do_returns_nothing_and_counts_nothing(model):
    engine = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8).llm_engine
    assert engine.step() == [] and engine.stats()["num_steps"] == 0
    engine.add_request("r", [1, 2], SamplingParams(temperature=0, max_tokens=1))
    assert [r.request_id for r in engine.step()] == ["r"]
    assert engine.step() == [] and engine.stats()["num_steps"] == 1


def test_the_id_of_a_live_prompt_with_n_children_is_taken(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)
    engine = llm.llm_engine
    engine.add_request("y", [1, 2], SamplingParams(n=2, temperature=0, max_tokens=2))
    before = engine_state(llm)
    with pytest.raises(ValueError, match="request_id 'y' is already in the engine"):
        engine.add_request("y", [3, 4], SamplingParams(temperature=0))
    assert engine_state(llm) == before
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("y", [3, 4], SamplingParams(temperature=0))  # free again once finished


def test_a_vllm_prompt_key_minipaged_does_not_serve_is_refused_by_name(model):
    llm = LLM(model=model, max_model_len=64, num_gpu_blocks_override=8)
    for key in ("token_type_ids", "multi_modal_data", "mm_processor_kwargs",
                "multi_modal_uuids"):
        with pytest.raises(ValueError, match=f"'{key}': a vLLM prompt key"):
            llm.generate({"prompt_token_ids": [1], key: None}, use_tqdm=False)
    assert not llm.llm_engine.requests and llm._next_id == 0
