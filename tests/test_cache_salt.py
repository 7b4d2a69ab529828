"""cache_salt (chapter 9): salts never share a block, one salt shares as no salt does, the salt
changes every hash from block 0, the API's forms and refusals, the attack's readings, and the
public-prefix manager."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import LLM, SamplingParams
from minipaged.cache_salt import (
    PublicPrefixKVCacheManager,
    accuracy,
    eviction_probes,
    membership_trials,
    prefix_guess_probes,
    replay,
    roc_auc,
    roc_curve,
    salted_block_hashes,
)
from minipaged.engine import check_cache_salt
from minipaged.model import ModelConfig, random_model
from minipaged.prefix_cache import (
    PrefixCachingBlockPool,
    PrefixCachingKVCacheManager,
    generate_block_hash_extra_keys,
    update_block_hashes,
)
from minipaged.scheduler import Request

B = 4  # small blocks, so that short random prompts span several

# --- the hash -----------------------------------------------------------------------------


@given(st.lists(st.integers(0, 50), min_size=B, max_size=8 * B), st.text(min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_a_salt_changes_the_first_block_hash_and_so_every_later_one(tokens, salt):
    plain = update_block_hashes(Request("a", tokens, SamplingParams()), B)
    salted = update_block_hashes(Request("b", tokens, SamplingParams(), cache_salt=salt), B)
    assert len(plain) == len(salted) == len(tokens) // B
    assert all(p != s for p, s in zip(plain, salted))
    # the salt is in block 0's extra keys only; the chain carries it on
    request = Request("c", tokens, SamplingParams(), cache_salt=salt)
    assert generate_block_hash_extra_keys(request, 0) == (("cache_salt", salt),)
    assert all(generate_block_hash_extra_keys(request, start) == ()
               for start in range(B, len(tokens), B))


@given(st.lists(st.integers(0, 50), max_size=8 * B), st.one_of(st.none(), st.text(min_size=1)))
@settings(max_examples=60, deadline=None)
def test_the_module_chain_is_chapter_8s(tokens, salt):
    request = Request("r", tokens, SamplingParams(), cache_salt=salt)
    assert salted_block_hashes(tokens, B, salt) == update_block_hashes(request, B)


def test_salts_that_differ_give_different_first_hashes():
    tokens = list(range(2 * B))
    hashes = {salt: salted_block_hashes(tokens, B, salt)[0] for salt in (None, "a", "b", "ab")}
    assert len(set(hashes.values())) == 4


# --- sharing: the properties --------------------------------------------------------------

PREFIXES = [[1] * (3 * B), [2] * (2 * B) + [3] * B, [1] * (2 * B) + [4] * B]
prompt = st.tuples(st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 9), max_size=6))
salts = st.sampled_from([None, "a", "b", "c"])


PUBLIC = PREFIXES[0][:2 * B]  # registered public prefix: the first two blocks of PREFIXES[0]
PUBLIC_HASHES = set(salted_block_hashes(PUBLIC, B))


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("public", [False, True])
@given(steps=st.lists(st.tuples(prompt, salts, st.booleans()), min_size=1, max_size=25))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_different_salts_never_share_a_block(public, steps):
    # Requests share prefixes often (three prefixes with common openings); some are held while
    # others arrive, some freed at once. At no moment is a block held by requests of two salts,
    # except, under the public-prefix manager, a block of the registered public prefix.
    pool = PrefixCachingBlockPool(400, B)
    manager = (PublicPrefixKVCacheManager(pool, public_prefix=PUBLIC) if public
               else PrefixCachingKVCacheManager(pool))
    held: dict[str, Request] = {}
    for index, ((which, tail), salt, keep) in enumerate(steps):
        request = Request(str(index), PREFIXES[which] + tail, SamplingParams(), cache_salt=salt)
        blocks, num_hits = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hits, blocks) is not None
        request.num_computed_tokens = request.num_tokens  # the step ran
        held[request.request_id] = request
        salts_of_block: dict[int, set] = {}
        for other in held.values():
            for block in manager.get_block_table(other).blocks:
                salts_of_block.setdefault(block.block_id, set()).add(other.cache_salt)
        shared = [i for i, s in salts_of_block.items() if len(s) > 1]
        assert all(public and pool.blocks[i].block_hash in PUBLIC_HASHES for i in shared)
        if not keep:
            manager.free(held.pop(request.request_id))


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@given(st.lists(prompt, min_size=1, max_size=25), st.text(min_size=1, max_size=5))
@settings(max_examples=60, deadline=None)
def test_one_salt_shares_exactly_as_no_salt(prompts, salt):
    tokens = [PREFIXES[which] + tail for which, tail in prompts]
    plain = replay(PrefixCachingKVCacheManager(PrefixCachingBlockPool(400, B)),
                   [(t, None) for t in tokens])
    salted = replay(PrefixCachingKVCacheManager(PrefixCachingBlockPool(400, B)),
                    [(t, salt) for t in tokens])
    assert plain == salted


def test_replay_counts_and_refuses_a_pool_too_small():
    manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(16, B))
    counts = replay(manager, [([5] * (3 * B + 1), "a"), ([5] * (3 * B + 1), "a"),
                              ([5] * (3 * B + 1), "b")])
    assert counts == dict(requests=3, queries=3 * (3 * B + 1), hits=3 * B,
                          computed=3 * (3 * B + 1) - 3 * B)
    with pytest.raises(ValueError, match="prompts"):
        replay(PrefixCachingKVCacheManager(PrefixCachingBlockPool(2, B)), [([1] * (4 * B), None)])


# --- the public-prefix manager ------------------------------------------------------------

SYSTEM = [7] * (2 * B + 1)  # two whole blocks and one token into the third


def test_public_prefix_shares_whole_public_blocks_only():
    manager = PublicPrefixKVCacheManager(PrefixCachingBlockPool(64, B), public_prefix=SYSTEM)
    counts = replay(manager, [(SYSTEM + [1] * (2 * B), "a"), (SYSTEM + [1] * (2 * B), "b")])
    assert counts["hits"] == 2 * B  # the third block holds a public token and private ones: salted
    a = Request("a", SYSTEM + [1] * (2 * B), SamplingParams(), cache_salt="a")
    b = Request("b", SYSTEM + [1] * (2 * B), SamplingParams(), cache_salt="b")
    ha, hb = manager.hash_request(a), manager.hash_request(b)
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))


@given(st.lists(st.integers(0, 9), max_size=4 * B), st.sampled_from(["a", "b"]))
@settings(max_examples=40, deadline=None)
def test_public_prefix_falls_back_to_chapter_8_when_the_prompt_does_not_begin_with_it(tail, salt):
    manager = PublicPrefixKVCacheManager(PrefixCachingBlockPool(64, B), public_prefix=SYSTEM)
    tokens = [8] + tail  # does not begin with the system prompt
    request = Request("r", tokens, SamplingParams(), cache_salt=salt)
    assert manager.salt_block(request) == 0
    assert manager.hash_request(request) == salted_block_hashes(tokens, B, salt)


def test_public_prefix_refuses_bad_tokens():
    with pytest.raises(ValueError, match="public_prefix"):
        PublicPrefixKVCacheManager(PrefixCachingBlockPool(8, B), public_prefix=[1, "x"])


# --- ROC and accuracy ---------------------------------------------------------------------


def test_roc_auc_against_the_pairwise_definition():
    rng = np.random.default_rng(0)
    scores, labels = rng.integers(0, 5, 40), rng.integers(0, 2, 40).astype(bool)
    pairs = [(p > n) + 0.5 * (p == n) for p in scores[labels] for n in scores[~labels]]
    assert roc_auc(scores, labels) == pytest.approx(np.mean(pairs))
    fpr, tpr = roc_curve(scores, labels)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    trapezoids = np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2
    assert trapezoids.sum() == pytest.approx(roc_auc(scores, labels))
    assert roc_auc([1, 2, 3, 4], [0, 0, 1, 1]) == 1 and roc_auc([1, 1, 1, 1], [0, 1, 0, 1]) == 0.5
    assert accuracy([1, 0, 1], [1, 1, 1]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("scores, labels", [([1, 2], [1, 1]), ([1, 2, 3], [0, 1])])
def test_roc_refuses_one_class_or_mismatched_lengths(scores, labels):
    with pytest.raises(ValueError, match="labels"):
        roc_auc(scores, labels)


# --- the API ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=1, max_position_embeddings=512), seed=0)


class ByteTokenizer:
    """A stand-in tokenizer: one token per byte."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, **_):
        return "".join(map(chr, ids))


ONE = SamplingParams(temperature=0, max_tokens=1)


def test_both_prompt_forms_carry_the_salt(model):
    llm = LLM(model=model, max_model_len=128, tokenizer=ByteTokenizer())
    text = "a document long enough for a few blocks of sixteen bytes each"
    tokens = ByteTokenizer().encode(text)
    first = llm.generate({"prompt": text, "cache_salt": "a"}, ONE, use_tqdm=False)[0]
    same = llm.generate({"prompt_token_ids": tokens, "cache_salt": "a"}, ONE, use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "cache_salt": "b"}, ONE, use_tqdm=False)[0]
    unsalted = llm.generate(text, ONE, use_tqdm=False)[0]
    assert first.prompt == text and first.prompt_token_ids == tokens
    assert first.num_cached_tokens == 0 and same.num_cached_tokens == 16 * (len(tokens) // 16)
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    engine = llm.llm_engine
    request_id = engine.add_request("x", tokens, ONE, cache_salt="a").request_id
    assert engine.requests[request_id].cache_salt == "a"


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("bad", ["", 3, b"a", ["a"], 1.5])
def test_a_bad_salt_is_refused_and_nothing_is_queued(model, bad):
    llm = LLM(model=model, max_model_len=128)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]},
                      {"prompt_token_ids": [4, 5, 6], "cache_salt": bad}], ONE)
    assert not engine.requests and not engine.has_unfinished_requests() and llm._next_id == 0
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("r", [1, 2, 3], ONE, cache_salt=bad)
    assert not engine.requests and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="cache_salt"):
        check_cache_salt(bad)


def test_a_text_prompt_needs_a_tokenizer_and_a_string(model):
    llm = LLM(model=model, max_model_len=128)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate({"prompt": "hello", "cache_salt": "a"}, ONE)
    with pytest.raises(ValueError, match="prompt must be a string"):
        LLM(model=model, max_model_len=128, tokenizer=ByteTokenizer()).generate({"prompt": 5}, ONE)
    assert not llm.llm_engine.requests


def test_a_salt_with_prefix_caching_off_is_accepted_and_changes_nothing(model):
    llm = LLM(model=model, max_model_len=128, enable_prefix_caching=False)
    tokens = list(range(40))
    salted = llm.generate({"prompt_token_ids": tokens, "cache_salt": "a"},
                          SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": tokens},
                         SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert salted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert salted.num_cached_tokens == 0


# --- the attack, read from the cached-token count (exact, not timed) ----------------------


@pytest.mark.heavy
def test_membership_is_exact_without_salts_and_chance_with_them(model):
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=256)
    rng = np.random.default_rng(0)
    plain = membership_trials(llm, 24, 32, rng)
    assert all((p.num_cached_tokens == 32) == p.cached for p in plain)
    assert all(p.counter_hits == p.num_cached_tokens for p in plain)
    salted = membership_trials(llm, 24, 32, rng, victim_salt="v", attacker_salt="x")
    assert all(p.num_cached_tokens == 0 and p.counter_hits == 0 for p in salted)
    assert roc_auc([p.num_cached_tokens for p in salted], [p.cached for p in salted]) == 0.5


@pytest.mark.heavy
def test_a_guess_is_confirmed_only_by_whole_blocks(model):
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=256)
    rng = np.random.default_rng(1)
    secret = rng.integers(0, 512, 48).tolist()
    rows = prefix_guess_probes(llm, secret, rng)
    assert [found for _, found, _ in rows] == [16 * (n // 16) for n in range(1, 49)]
    salted = prefix_guess_probes(llm, secret, rng, "v", "x")
    assert all(found == 0 for _, found, _ in salted)


@pytest.mark.heavy
def test_eviction_reads_the_victims_blocks_through_salts(model):
    llm = LLM(model=model, max_model_len=256, num_gpu_blocks_override=16)
    rows = eviction_probes(llm, [5, 40, 100, 200], np.random.default_rng(2), "v", "x")
    assert [(blocks, lost) for blocks, lost, _ in rows] == [(1, 1), (3, 3), (7, 7), (13, 13)]
    with pytest.raises(ValueError, match="max_model_len"):
        eviction_probes(LLM(model=model, max_model_len=128, num_gpu_blocks_override=16), [5],
                        np.random.default_rng(2))


@pytest.mark.parametrize("bad", ["", "\ud800", "a\udfffb", 3])
def test_a_request_built_directly_follows_the_llm_salt_rule(model, bad):
    """One rule for LLM, LLMEngine and Request: an empty salt is refused, not read as none,
    and a string with no UTF-8 bytes is a ValueError naming cache_salt."""
    with pytest.raises(ValueError, match="cache_salt"):
        Request("r", [1, 2, 3], ONE, cache_salt=bad)
    llm = LLM(model=model, max_model_len=128)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": [1, 2, 3], "cache_salt": bad}, ONE, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.llm_engine.add_request("r", [1, 2, 3], ONE, cache_salt=bad)
    assert not llm.llm_engine.requests and llm._next_id == 0


def test_a_misspelt_salt_key_is_refused_not_run_unsalted(model):
    llm = LLM(model=model, max_model_len=128)
    with pytest.raises(ValueError, match="'cache-salt'"):
        llm.generate({"prompt_token_ids": list(range(40)), "cache-salt": "t"}, ONE,
                     use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_queries"] == 0 and llm._next_id == 0
