"""The engine end to end: greedy answers equal transformers' in every regime, bad input refused."""
import inspect
import os
import subprocess
import sys

import pytest
import torch

import minipaged.engine
import minipaged.scheduler
from minipaged import LLM, SamplingParams
from minipaged.huggingface import save_pretrained, to_transformers
from minipaged.model import ModelConfig, random_model

MAX_TOKENS = 12
LENGTHS = [3, 9, 17, 33, 5, 24]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds synchronisation
    yield
    torch.set_num_threads(threads)


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


def test_abandoned_stream_frees_its_blocks(model, prompts):
    llm = LLM(model=model, max_model_len=128)
    stream = llm.stream({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=50))
    next(stream)
    stream.close()
    pool = llm.llm_engine.pool
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_allocator_called_once_per_block_in_decode(model):
    llm = LLM(model=model, max_model_len=512)
    llm.generate({"prompt_token_ids": list(range(9))},
                 SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_steps"] == 100
    assert stats["num_allocator_calls"] == -(-(9 + 100 - 1) // 16)


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


def test_prefix_caching_is_on_by_default_as_in_vllm(model):
    from minipaged.prefix_cache import PrefixCachingKVCacheManager

    assert minipaged.engine.KV_CACHE_MANAGERS == {
        False: minipaged.scheduler.KVCacheManager, True: PrefixCachingKVCacheManager}
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
    per_token = llm.model.config.kv_bytes_per_token(4)
    assert pool.num_blocks == 256 * 2**20 // (per_token * 16)
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
    assert not hasattr(module, "generate") and not hasattr(module, "schedule")


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
