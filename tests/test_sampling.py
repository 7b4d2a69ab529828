"""SamplingParams validation and the sampler: greedy rows, seeded draws, top-k and top-p."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
