"""SamplingParams validation and the sampler: greedy rows, seeded draws, top-k and top-p."""
import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import LLM
from minipaged.bad_inputs import BAD_SAMPLING_PARAMS
from minipaged.model import ModelConfig, random_model
from minipaged.sampling import SamplingParams, filter_top_k_top_p, sample


@pytest.mark.parametrize("field, value", [("max_tokens", 0), ("max_tokens", -3),
                                          ("temperature", -0.1), ("top_p", 0.0),
                                          ("top_p", 1.01), ("top_k", -2), ("n", 0)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
    assert SamplingParams(temperature=0).greedy and not params.greedy


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert tokens == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_neighbours():
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=5)

    def draws(neighbour_seed):
        gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(neighbour_seed)]
        return [sample(logits, [params, params], gens)[0] for _ in range(20)]

    assert draws(0) == draws(123)


@settings(max_examples=30, deadline=None)
@given(top_k=st.integers(1, 20), seed=st.integers(0, 1000))
def test_top_k_keeps_exactly_the_k_largest(top_k, seed):
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed))
    kept = torch.isfinite(filter_top_k_top_p(logits, top_k, 1.0))
    assert kept.sum() == top_k
    assert set(kept.nonzero().flatten().tolist()) == set(logits.topk(top_k).indices.tolist())


@settings(max_examples=30, deadline=None)
@given(top_p=st.floats(0.01, 1.0), seed=st.integers(0, 1000))
def test_top_p_keeps_the_smallest_nucleus(top_p, seed):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(seed))
    kept = torch.isfinite(filter_top_k_top_p(logits, 0, top_p))
    probs = logits.softmax(-1)
    assert probs[kept].sum() >= top_p - 1e-6 or kept.all()
    smallest_kept = probs[kept].min()
    assert probs[kept].sum() - smallest_kept < top_p + 1e-6  # dropping one more falls short
    assert bool(kept[probs.argmax()])


def test_sampled_tokens_stay_inside_the_filter():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=2.0, top_k=3)]
    assert {sample(logits, params, [gen])[0] for _ in range(100)} <= allowed


# ---------------------------------------------------------------- bad input


def test_every_catalogued_bad_value_is_a_value_error_naming_its_field():
    for field, value in BAD_SAMPLING_PARAMS:
        with pytest.raises(ValueError, match=rf"\b{field}\b"):
            SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", BAD_SAMPLING_PARAMS,
                         ids=[f"{f}={v!r}" for f, v in BAD_SAMPLING_PARAMS])
def test_a_bad_value_set_later_is_refused_and_the_old_one_kept(field, value):
    params = SamplingParams(temperature=0.5, seed=3, stop_token_ids=[7], max_tokens=4)
    before = dataclasses.asdict(params)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        setattr(params, field, value)
    assert dataclasses.asdict(params) == before


def test_values_are_stored_as_plain_python_types():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint8(7),
                            stop_token_ids=(np.int64(5), 6), max_tokens=np.int32(8))
    assert (type(params.temperature), type(params.top_k), type(params.seed)) == (float, int, int)
    assert params.stop_token_ids == [5, 6] and type(params.stop_token_ids[0]) is int
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    ids = [1, 2]
    params = SamplingParams(stop_token_ids=ids)
    ids.append(3)  # the caller's list is copied, not shared
    assert params.stop_token_ids == [1, 2]


def test_an_integer_too_large_for_a_float_is_a_value_error():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=10**400)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


# What each field accepts, written from the specification rather than from the code.
VALID = {
    "n": lambda v: is_int(v) and v >= 1,
    "temperature": lambda v: is_real(v) and v >= 0,
    "top_p": lambda v: is_real(v) and 0 < v <= 1,
    "top_k": lambda v: is_int(v) and v >= -1,
    "seed": lambda v: v is None or (is_int(v) and 0 <= v < 2**63),
    "stop_token_ids": lambda v: v is None or (isinstance(v, (list, tuple))
                                              and all(is_int(t) and t >= 0 for t in v)),
    "ignore_eos": lambda v: isinstance(v, bool),
    "max_tokens": lambda v: v is None or (is_int(v) and v >= 1),
}


def test_the_property_tests_list_of_fields_is_the_dataclasses_own():
    import dataclasses

    from minipaged.sampling import FIELD_CHECKS

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(VALID) == fields == set(FIELD_CHECKS)


ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4),
    st.lists(st.one_of(st.integers(-5, 2**40), st.floats(), st.booleans(), st.text(max_size=2)),
             max_size=3),
    st.tuples(st.integers(-3, 100)), st.binary(max_size=2), st.dictionaries(st.text(), st.none()))


@pytest.fixture(scope="module")
def small_llm(one_thread):
    return LLM(model=random_model(ModelConfig.small(num_layers=1), seed=0), max_model_len=64,
               num_gpu_blocks_override=6)


def engine_state(llm):
    engine = llm.llm_engine
    return (engine.pool.get_num_free_blocks(), [r.request_id for r in engine.scheduler.waiting],
            [r.request_id for r in engine.scheduler.running], sorted(engine.requests),
            llm._next_id)


GOOD_PROMPT = {"prompt_token_ids": [3, 1, 4, 1, 5]}
GOOD_PARAMS = dict(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.mark.heavy  # over a second: make test runs it, make check does not
@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(sorted(VALID)), value=ANY_VALUE)
def test_any_value_is_stored_or_refused_by_name_and_the_engine_is_untouched(
        small_llm, field, value):
    engine = small_llm.llm_engine
    if not engine.requests:  # keep one request inside the engine across examples
        engine.add_request(f"kept-{small_llm._next_id}", [9, 9, 9],
                           SamplingParams(**GOOD_PARAMS))
        small_llm._next_id += 1
    before = engine_state(small_llm)
    if VALID[field](value):
        stored = getattr(SamplingParams(**{field: value}), field)
        if field in ("temperature", "top_p"):  # stored as a float: 2**53 + 1 becomes 2**53
            assert stored == float(value) and type(stored) is float
            return
        assert stored == (list(value) if isinstance(value, tuple) else value or
                          ([] if field == "stop_token_ids" else value))
        return
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        small_llm.generate(GOOD_PROMPT, SamplingParams(**{field: value}), use_tqdm=False)
    params = SamplingParams(**GOOD_PARAMS)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        setattr(params, field, value)
    assert engine_state(small_llm) == before
    out = small_llm.generate(GOOD_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == reference_answer()


@functools.lru_cache
def reference_answer():
    llm = LLM(model=random_model(ModelConfig.small(num_layers=1), seed=0), max_model_len=64,
              num_gpu_blocks_override=6)
    return llm.generate(GOOD_PROMPT, SamplingParams(**GOOD_PARAMS),
                        use_tqdm=False)[0].outputs[0].token_ids


def test_best_of_and_other_names_that_are_not_fields_are_refused():
    params = SamplingParams(n=2)
    with pytest.raises(ValueError, match="best_of was removed in vLLM v1"):
        params.best_of = 2
    with pytest.raises(ValueError, match="no field 'temprature'"):
        params.temprature = 0.5
    assert not hasattr(params, "best_of") and params.n == 2


def test_n_children_need_room_for_their_seeds():
    """Child i samples with seed + i: the top seed is valid alone, refused with n = 2."""
    top = 2**63 - 1
    assert SamplingParams(seed=top).seed == top
    assert SamplingParams(n=2, seed=top - 1).seed == top - 1
    with pytest.raises(ValueError, match=r"seed=9223372036854775807 with n=2"):
        SamplingParams(n=2, seed=top)
    params = SamplingParams(seed=top)
    with pytest.raises(ValueError, match=r"with n=2"):
        params.n = 2
    assert params.n == 1
    params = SamplingParams(n=3)
    with pytest.raises(ValueError, match=r"below 2\*\*63 - 2"):
        params.seed = top - 1
    assert params.seed is None
