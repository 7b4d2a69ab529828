"""Parallel sampling (chapter 10): split and fork give the same answers, copy-on-write never
writes into a shared block, counts return to zero, and one forked child can be preempted."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minipaged.sharing
from minipaged import LLM, SamplingParams
from minipaged.engine import LLMEngine
from minipaged.kv_cache import KVCache
from minipaged.model import ModelConfig, random_model
from minipaged.prefix_cache import PrefixCachingKVCacheManager
from minipaged.scheduler import (
    KVCacheManager,
    ParentRequest,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from minipaged.sharing import (
    CopyingEngine,
    CopyOnWriteError,
    CopyOnWriteKVCacheManager,
    CopyOnWritePrefixCachingKVCacheManager,
    CopyOnWriteSubBlockPrefixCachingKVCacheManager,
    ForkingEngine,
    SubBlockPrefixCachingKVCacheManager,
    check_writes,
    copy_blocks,
    reference_copy_blocks,
)

MAX_LEN = 128


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=1, max_position_embeddings=MAX_LEN), seed=0)


def prompt_of(length, seed=1):
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(model, mode, blocks=64, cache=False, **options):
    return LLM(model=model, seed=0, max_model_len=MAX_LEN, num_gpu_blocks_override=blocks,
               enable_prefix_caching=cache, parallel_sampling=mode, **options)


def answers(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]


def assert_all_free(llm):
    pool = llm.llm_engine.pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not llm.llm_engine.requests and not llm.llm_engine.parent_requests
    assert not getattr(llm.llm_engine, "held", {})  # a forking engine's children held back
    manager = llm.llm_engine.scheduler.kv_cache_manager
    assert not manager.block_tables and not getattr(manager, "blocks_to_copy", [])


# --- the parent and its children ----------------------------------------------------------


def test_child_ids_and_seeds_follow_vllm():
    parent = ParentRequest("7", [1, 2], SamplingParams(n=3, seed=10, temperature=0.5))
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [child_id for child_id, _ in infos] == ["0_7", "1_7", "2_7"]
    assert [p.seed for _, p in infos] == [10, 11, 12]
    assert all(p.n == 1 and p.temperature == 0.5 for _, p in infos)
    unseeded = ParentRequest("x", [1], SamplingParams(n=2))
    assert [unseeded.get_child_info(i)[1].seed for i in range(2)] == [None, None]


@pytest.mark.parametrize("n", [0, -1, True, 1.5, "2"])
def test_bad_n_is_refused(n):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=n)


def test_bad_mode_is_refused(model):
    with pytest.raises(ValueError, match="parallel_sampling"):
        make_llm(model, "clone")


@pytest.mark.parametrize("mode", ["split", "fork"])
def test_generate_returns_one_output_with_n_completions(model, mode):
    llm = make_llm(model, mode)
    params = [SamplingParams(n=3, seed=1, max_tokens=4), SamplingParams(max_tokens=2)]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8]}], params,
                        use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1"]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [len(c.token_ids) for c in outs[0].outputs] == [4, 4, 4]
    assert len(outs[1].outputs) == 1 and outs[0].finished and outs[1].finished
    assert_all_free(llm)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("mode", ["split", "fork"])
def test_stream_with_n_gives_the_same_tokens_as_generate(model, mode):
    prompts = [{"prompt_token_ids": prompt_of(21)}, {"prompt_token_ids": prompt_of(5, 2)}]
    params = [SamplingParams(n=3, seed=4, max_tokens=5), SamplingParams(n=2, max_tokens=3)]
    streamed = {}
    for out in make_llm(model, mode).stream(prompts, params):
        for completion in out.outputs:
            streamed.setdefault((out.request_id, completion.index), []).extend(
                completion.token_ids)
    whole = make_llm(model, mode).generate(prompts, params, use_tqdm=False)
    assert streamed == {(o.request_id, c.index): c.token_ids for o in whole for c in o.outputs}


def test_a_stream_closed_early_withdraws_held_children(model):
    llm = make_llm(model, "fork")
    stream = llm.stream({"prompt_token_ids": prompt_of(40)}, SamplingParams(n=4, max_tokens=8))
    next(stream)
    stream.close()
    assert_all_free(llm)


# --- fork against split --------------------------------------------------------------------


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("seed", [3, None])
def test_fork_and_split_sample_the_same_tokens(model, cache, seed):
    prompts = [{"prompt_token_ids": prompt_of(n, n)} for n in (9, 16, 37)]
    params = SamplingParams(n=4, seed=seed, temperature=1.0, max_tokens=10, ignore_eos=True)
    split = make_llm(model, "split", cache=cache)
    fork = make_llm(model, "fork", cache=cache)
    assert answers(split, prompts, params) == answers(fork, prompts, params)
    assert_all_free(split)
    assert_all_free(fork)


def test_fork_reports_child_0s_cached_tokens_never_more_than_split(model):
    """Chapter 10's stated difference from vLLM (which splits): a forked child reports child 0's
    count, so a prompt's num_cached_tokens under fork is at most split's."""
    prompts = [{"prompt_token_ids": prompt_of(n, n)} for n in (9, 16, 37, 37)]  # 37 twice: a hit
    params = SamplingParams(n=3, seed=0, temperature=1.0, max_tokens=4, ignore_eos=True)
    counts = {mode: [o.num_cached_tokens for o in make_llm(model, mode, cache=True)
                     .generate(prompts, params, use_tqdm=False)] for mode in ("split", "fork")}
    assert all(f <= s for f, s in zip(counts["fork"], counts["split"])), counts


@pytest.mark.parametrize("length, copies", [(37, 3), (32, 0)])
def test_fork_computes_the_prompt_once_and_copies_n_minus_one_partial_blocks(model, length,
                                                                              copies):
    llm = make_llm(model, "fork")
    llm.generate({"prompt_token_ids": prompt_of(length)},
                 SamplingParams(n=4, max_tokens=6, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["num_computed_tokens"] == length + 4 * 5  # one prefill, then 5 decodes each
    assert stats["num_copied_blocks"] == copies  # a full last block is never written again


# --- the copy kernel and the write check ---------------------------------------------------


def test_copy_kernel_equals_reference():
    a = KVCache(2, 6, 4, 2, 8)
    for layer in a.layers:
        layer.copy_(torch.randn_like(layer))
    b = KVCache(2, 6, 4, 2, 8)
    for mine, theirs in zip(b.layers, a.layers):
        mine.copy_(theirs)
    copy_blocks(a, [0, 3, 4], [5, 1, 2], chunk=16)  # a chunk smaller than a block (64 values)
    reference_copy_blocks(b, [0, 3, 4], [5, 1, 2])
    assert all(torch.equal(x, y) for x, y in zip(a.layers, b.layers))
    assert torch.equal(a.layers[1][5], a.layers[1][0])


@pytest.mark.parametrize("src, dst", [([0], [1, 2]), ([0], [6]), ([0, 1], [2, 2]),
                                      ([0, 1], [1, 2])])
def test_bad_copy_pairs_are_refused_before_any_copy(src, dst):
    cache = KVCache(1, 6, 4, 1, 8)
    cache.layers[0].copy_(torch.randn_like(cache.layers[0]))
    before = cache.layers[0].clone()
    with pytest.raises(ValueError, match="block"):
        copy_blocks(cache, src, dst)
    assert torch.equal(cache.layers[0], before)


COPY_ON_WRITE = {KVCacheManager: CopyOnWriteKVCacheManager,
                 PrefixCachingKVCacheManager: CopyOnWritePrefixCachingKVCacheManager}


def forked_pair(base=KVCacheManager, num_blocks=8, prompt=6, block_size=4):
    """A copy-on-write manager with a parent of `prompt` computed tokens and a forked child,
    and a cache of random values for its blocks."""
    pool = base.pool_class(num_blocks, block_size)
    manager = COPY_ON_WRITE[base](pool)
    kv_cache = KVCache(1, num_blocks, block_size, 1, 8)
    kv_cache.layers[0].copy_(torch.randn_like(kv_cache.layers[0]))
    params = SamplingParams(max_tokens=4)
    parent, child = Request("p", list(range(prompt)), params), Request("c", list(range(prompt)),
                                                                      params)
    assert manager.allocate_slots(parent, prompt) is not None
    parent.num_computed_tokens = child.num_computed_tokens = prompt
    manager.fork(parent, child)
    parent.append_output_token(1)
    child.append_output_token(2)
    return manager, kv_cache, parent, child


def make_copies(manager, kv_cache):
    """What CopyingEngine.execute does before the forward pass: the recorded copies, made."""
    copies = manager.start_forward()
    try:
        copy_blocks(kv_cache, [s.block_id for s, _ in copies], [c.block_id for _, c in copies])
    finally:
        manager.copies_made(copies)


@pytest.mark.parametrize("base", [KVCacheManager, PrefixCachingKVCacheManager])
def test_copy_on_write_copies_the_shared_block_before_the_write(base):
    manager, kv_cache, parent, child = forked_pair(base)
    shared = manager.block_tables["p"].blocks[1]  # positions 4-5 written, 6 is next
    assert shared.ref_cnt == 2
    assert manager.allocate_slots(child, 1) is not None
    copy = manager.block_tables["c"].blocks[1]
    assert shared.ref_cnt == 2  # the parent, and the copy still to be made
    assert manager.blocks_to_copy == [(shared, copy)]
    assert manager.allocate_slots(parent, 1) is not None  # the last holder writes in place
    make_copies(manager, kv_cache)  # the engine does this just before the forward pass
    assert manager.blocks_to_copy == []
    assert copy is not shared and copy.ref_cnt == 1 and shared.ref_cnt == 1
    layer = kv_cache.layers[0]
    assert torch.equal(layer[copy.block_id], layer[shared.block_id])
    assert manager.block_tables["c"].blocks[0] is manager.block_tables["p"].blocks[0]
    assert manager.block_tables["p"].blocks[1] is shared and manager.num_copied_blocks == 1
    check_writes(manager, SchedulerOutput([parent, child], {"p": 1, "c": 1}, []))  # both pass


def test_the_write_path_refuses_a_shared_block():
    manager, _, parent, child = forked_pair()
    KVCacheManager.allocate_slots(manager, child, 1)  # growth without copy-on-write
    with pytest.raises(CopyOnWriteError, match="would write into block"):
        check_writes(manager, SchedulerOutput([child], {"c": 1}, []))  # position 6: shared
    assert child.num_computed_tokens == 4 * (child.num_computed_tokens // 4) + 2  # mid-block


def test_a_row_with_no_new_tokens_writes_nothing():
    manager, _, parent, child = forked_pair()
    KVCacheManager.allocate_slots(manager, child, 1)  # growth without copy-on-write
    # a forked child's row (ForkingEngine.fork books it with 0 tokens) writes no key or value
    check_writes(manager, SchedulerOutput([child], {"c": 0}, []))


def test_an_engine_without_copy_on_write_is_stopped_before_the_write(model, monkeypatch):
    # check_writes runs before the forward pass, on the blocks each request's new tokens land in
    llm = LLM(model=model, seed=0, max_model_len=MAX_LEN, num_gpu_blocks_override=64,
              enable_prefix_caching=False, parallel_sampling="fork")
    manager = llm.llm_engine.scheduler.kv_cache_manager
    monkeypatch.setattr(type(manager), "shared_write_targets", lambda self, r, n: [])
    before = [layer.clone() for layer in llm.llm_engine.kv_cache.layers]
    engine = llm.llm_engine
    engine.add_request("g", prompt_of(37), SamplingParams(n=2, max_tokens=4))
    engine.step()  # the prefill, and the fork
    written = [layer.clone() for layer in engine.kv_cache.layers]
    assert not all(torch.equal(a, b) for a, b in zip(before, written))
    with pytest.raises(CopyOnWriteError):
        engine.step()  # both children would write their first token into the shared block
    assert all(torch.equal(a, b) for a, b in zip(written, engine.kv_cache.layers))


def test_a_refused_copy_changes_nothing():
    manager, _, parent, child = forked_pair(num_blocks=2, prompt=6)  # both held, none free
    tables = {k: list(t.blocks) for k, t in manager.block_tables.items()}
    counts = [b.ref_cnt for b in manager.pool.blocks]
    assert manager.allocate_slots(child, 1) is None
    assert {k: list(t.blocks) for k, t in manager.block_tables.items()} == tables
    assert [b.ref_cnt for b in manager.pool.blocks] == counts and manager.num_copied_blocks == 0
    assert manager.blocks_to_copy == []


# --- preempting one child of a forked group ------------------------------------------------


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("cache", [False, True])
def test_preempting_one_forked_child(model, cache):
    """The victim drops its count on every shared block (they survive: its siblings hold them),
    returns its private blocks, recomputes its prompt and tokens, and answers as if never
    preempted."""
    prompt = prompt_of(37)
    params = SamplingParams(n=3, seed=5, max_tokens=8, ignore_eos=True)
    expected = answers(make_llm(model, "split"), {"prompt_token_ids": prompt}, params)
    llm = make_llm(model, "fork", cache=cache)
    engine = llm.llm_engine
    parent = engine.add_request("g", prompt, params)
    while parent.child_requests[2].num_output_tokens < 3:
        engine.step()
    victim, sibling = parent.child_requests[1], parent.child_requests[0]
    manager = engine.scheduler.kv_cache_manager
    shared = [b for b in manager.block_tables[victim.request_id].blocks if b.ref_cnt == 3]
    assert len(shared) == 37 // 16  # the full prompt blocks, held by all three
    engine.scheduler.running.remove(victim)
    out = SchedulerOutput([], {}, [])
    engine.scheduler.preempt(victim, out)
    assert out.preempted_requests == [victim]
    assert all(b.ref_cnt == 2 for b in shared)  # one owner fewer, still alive
    assert manager.block_tables[sibling.request_id].blocks[:len(shared)] == shared
    assert victim.num_computed_tokens == 0 and victim.status is RequestStatus.PREEMPTED
    while engine.has_unfinished_requests():
        engine.step()
    assert [c.output_token_ids for c in parent.child_requests] == expected[0]
    assert_all_free(llm)


# --- properties ----------------------------------------------------------------------------


@pytest.mark.heavy
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 5), lengths=st.lists(st.integers(1, 60), min_size=1, max_size=3),
       blocks=st.integers(MAX_LEN // 16, 40), cache=st.booleans(), mode=st.sampled_from(
           ["split", "fork"]), max_tokens=st.integers(1, 20))
def test_any_pool_any_n_same_answers_and_counts_back_to_zero(model, n, lengths, blocks, cache,
                                                             mode, max_tokens):
    prompts = [{"prompt_token_ids": prompt_of(length, i)} for i, length in enumerate(lengths)]
    params = SamplingParams(n=n, seed=9, max_tokens=max_tokens, ignore_eos=True)
    expected = answers(make_llm(model, "split", blocks=256), prompts, params)
    llm = make_llm(model, mode, blocks=blocks, cache=cache)  # 8 blocks: starved
    assert answers(llm, prompts, params) == expected
    assert_all_free(llm)


@pytest.mark.parametrize("mode, cache, unit, engine_cls, manager_cls", [
    ("split", False, None, LLMEngine, KVCacheManager),
    ("split", True, None, LLMEngine, PrefixCachingKVCacheManager),
    ("split", True, 16, LLMEngine, PrefixCachingKVCacheManager),  # whole blocks: chapter 8's
    ("split", True, 4, CopyingEngine, SubBlockPrefixCachingKVCacheManager),
    ("fork", False, None, ForkingEngine, CopyOnWriteKVCacheManager),
    ("fork", True, None, ForkingEngine, CopyOnWritePrefixCachingKVCacheManager),
    ("fork", True, 4, ForkingEngine, CopyOnWriteSubBlockPrefixCachingKVCacheManager),
])
def test_the_options_choose_static_classes(model, mode, cache, unit, engine_cls, manager_cls):
    from minipaged.llm import ENGINE_CLASSES, KV_CACHE_MANAGER_CLASSES

    llm = make_llm(model, mode, cache=cache, prefix_match_unit=unit)
    engine = llm.llm_engine
    assert type(engine) is engine_cls and type(engine.scheduler) is Scheduler
    assert type(engine.scheduler.kv_cache_manager) is manager_cls
    assert manager_cls in KV_CACHE_MANAGER_CLASSES.values()
    assert engine_cls in ENGINE_CLASSES.values()
    # every class is defined in a module, not made at run time
    for cls in (engine_cls, manager_cls):
        assert getattr(__import__(cls.__module__, fromlist=["_"]), cls.__name__) is cls


def test_the_engine_classes_refuse_a_manager_that_cannot_serve_them(model):
    engine = ForkingEngine(model, 64, max_model_len=MAX_LEN,
                           kv_cache_manager_cls=CopyOnWriteKVCacheManager)
    assert type(engine.scheduler.kv_cache_manager) is CopyOnWriteKVCacheManager
    with pytest.raises(ValueError, match="ForkingEngine needs"):
        ForkingEngine(model, 64, max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="copy-on-write"):  # copies alone cannot fork
        ForkingEngine(model, 64, max_model_len=MAX_LEN,
                      kv_cache_manager_cls=SubBlockPrefixCachingKVCacheManager)
    with pytest.raises(ValueError, match="BlockCopies"):
        CopyingEngine(model, 64, max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="engine_cls"):  # the package's LLM chooses classes
        LLM(model=model, max_model_len=MAX_LEN, num_gpu_blocks_override=64,
            engine_cls=ForkingEngine)


def test_chapter_7s_front_end_takes_the_classes_themselves(model):
    from minipaged.frontend import LLMFrontEnd

    prompt = {"prompt_token_ids": prompt_of(37)}
    params = SamplingParams(n=3, seed=2, max_tokens=5, ignore_eos=True)
    llm = LLMFrontEnd(model, max_model_len=MAX_LEN, num_gpu_blocks_override=64,
                      engine_cls=ForkingEngine, kv_cache_manager_cls=CopyOnWriteKVCacheManager)
    assert type(llm.llm_engine) is ForkingEngine
    assert answers(llm, [prompt], params) == answers(make_llm(model, "split"), [prompt], params)
    assert llm.llm_engine.stats()["num_copied_blocks"] == 2
    assert_all_free(llm)
    with pytest.raises(ValueError, match="parallel_sampling"):  # an option of the package's LLM
        LLMFrontEnd(model, max_model_len=MAX_LEN, parallel_sampling="fork")


# --- sub-block prefix matching -------------------------------------------------------------


def sub_block_llm(model, unit, mode="split", blocks=256):
    return make_llm(model, mode, blocks=blocks, cache=True, prefix_match_unit=unit)


def shared_prefix_prompts(lengths, seed=0):
    """One long base prompt, and prompts agreeing with it on the given numbers of tokens."""
    base = prompt_of(100, seed)
    rng = torch.Generator().manual_seed(seed + 1)
    return [{"prompt_token_ids": base[:k] + torch.randint(0, 512, (9,), generator=rng).tolist()}
            for k in lengths]


def test_a_partial_match_finds_the_agreeing_tokens_and_copies_once(model):
    llm = sub_block_llm(model, 1)
    first = prompt_of(60)
    greedy = SamplingParams(temperature=0, max_tokens=3)
    llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": first[:37] + [1, 2]}, greedy, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert (stats["sub_block_tokens"], stats["sub_block_copies"]) == (5, 1)
    assert stats["prefix_cache_hits"] == 32
    (plain,) = make_llm(model, "split").generate({"prompt_token_ids": first[:37] + [1, 2]},
                                                  greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_all_free(llm)


def test_the_unit_rounds_the_match_down(model):
    llm = sub_block_llm(model, 4)
    first = prompt_of(60)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)
    llm.generate({"prompt_token_ids": first[:39] + [1, 2]}, greedy, use_tqdm=False)
    assert llm.llm_engine.stats()["sub_block_tokens"] == 4  # 7 agree, rounded down to 4


def test_a_salt_keeps_first_blocks_apart(model):
    manager = sub_block_llm(model, 1).llm_engine.scheduler.kv_cache_manager
    assert isinstance(manager, SubBlockPrefixCachingKVCacheManager)
    plain = Request("a", [1, 2, 3], SamplingParams())
    salted = Request("b", [1, 2, 3], SamplingParams(), cache_salt="s")
    assert manager.chain_key(plain, 0) != manager.chain_key(salted, 0)


@pytest.mark.parametrize("unit, message", [(3, "power of two"), (32, "dividing"),
                                           (0, "prefix_match_unit")])
def test_bad_units_are_refused(model, unit, message):
    llm = sub_block_llm(model, 4)
    manager = llm.llm_engine.scheduler.kv_cache_manager
    with pytest.raises(ValueError, match=message):
        manager.set_prefix_match_unit(unit)
    assert manager.prefix_match_unit == 4
    with pytest.raises(ValueError, match=message):
        sub_block_llm(model, unit)
    with pytest.raises(ValueError, match="prefix cache"):
        make_llm(model, "split", prefix_match_unit=4)


def test_the_unit_is_fixed_while_blocks_are_held(model):
    llm = sub_block_llm(model, 4)
    engine = llm.llm_engine
    engine.add_request("a", prompt_of(20), SamplingParams(max_tokens=2))
    engine.step()
    manager = engine.scheduler.kv_cache_manager
    with pytest.raises(ValueError, match="no block is held"):
        manager.set_prefix_match_unit(1)
    assert manager.prefix_match_unit == 4
    engine.abort_request("a")
    manager.set_prefix_match_unit(1)
    assert manager.prefix_match_unit == 1


@pytest.mark.heavy
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 100), min_size=2, max_size=6),
       unit=st.sampled_from([1, 2, 8]), blocks=st.integers(MAX_LEN // 16, 40),
       mode=st.sampled_from(["split", "fork"]), n=st.integers(1, 3))
def test_sub_block_hits_give_the_answers_of_no_cache(model, lengths, unit, blocks, mode, n):
    prompts = shared_prefix_prompts(lengths)
    params = SamplingParams(n=n, seed=2, max_tokens=6, ignore_eos=True)
    expected = answers(make_llm(model, "split", blocks=256), prompts, params)
    llm = sub_block_llm(model, unit, mode, blocks)
    got = []
    for prompt in prompts:  # one after another, so that each finds what the others left
        got += answers(llm, [prompt], params)
    assert got == expected
    assert_all_free(llm)


def test_a_partial_hit_that_needs_the_whole_pool_is_admitted(model):
    # the copy's source is held while the copy waits: when the pool has no block for it, the
    # request takes the whole blocks only (it once was refused, and the engine stopped)
    first = prompt_of(120)
    second = first[:100] + prompt_of(13, 5)  # 6 whole blocks and 4 tokens agree: 113 tokens
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = answers(make_llm(model, "split", blocks=8), [{"prompt_token_ids": second}], greedy)
    llm = sub_block_llm(model, 4, blocks=MAX_LEN // 16)  # the pool holds one sequence, no more
    llm.generate({"prompt_token_ids": first}, SamplingParams(max_tokens=1), use_tqdm=False)
    assert answers(llm, [{"prompt_token_ids": second}], greedy) == expected
    assert llm.llm_engine.stats()["sub_block_hits"] == 0
    assert_all_free(llm)


@pytest.mark.heavy  # a second each: forks that swap under pressure
@pytest.mark.parametrize("cache", [False, True])
def test_fork_under_preemption_by_swap(model, cache):
    """Chapter 11's swaps and this chapter's copies are both made just before the forward pass,
    swaps first: a block a swapped-out child frees may be a copy's destination in the same step."""
    prompts = [{"prompt_token_ids": prompt_of(n, n)} for n in (37, 50, 9)]
    params = SamplingParams(n=3, seed=1, max_tokens=30, ignore_eos=True)
    expected = answers(make_llm(model, "split", blocks=256), prompts, params)
    llm = LLM(model=model, seed=0, max_model_len=MAX_LEN, num_gpu_blocks_override=10,
              enable_prefix_caching=cache, parallel_sampling="fork", preemption_mode="swap")
    assert answers(llm, prompts, params) == expected
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert_all_free(llm)


# --- aborts, closed streams and faults (issue 26) -------------------------------------------


def step_until_done(engine, limit=500):
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"the engine is stuck: requests left after {limit} steps")


@pytest.mark.parametrize("mode", ["split", "fork"])
def test_aborting_the_id_the_outputs_carry_stops_every_child(model, mode):
    llm = make_llm(model, mode)
    engine = llm.llm_engine
    stream = llm.stream({"prompt_token_ids": prompt_of(37)},
                        SamplingParams(n=3, seed=1, max_tokens=8, ignore_eos=True))
    first = next(stream)
    parent = engine.parent_requests[first.request_id]  # the outputs carry the prompt's id
    children = parent.child_requests
    steps, produced = engine.num_steps, [list(c.output_token_ids) for c in children]
    engine.abort_request(first.request_id)
    assert all(c.status is RequestStatus.FINISHED_ABORTED for c in children)
    rest = list(stream)
    assert engine.num_steps == steps  # nothing was computed after the abort
    streamed = {}
    for out in [first] + rest:
        assert out.request_id == first.request_id
        for completion in out.outputs:
            streamed.setdefault(completion.index, []).extend(completion.token_ids)
    assert [streamed.get(i, []) for i in range(3)] == produced  # only what was routed already
    ends = [c for out in rest for c in out.outputs if c.finish_reason == "abort"]
    assert sorted(c.index for c in ends) == [0, 1, 2] and not any(c.token_ids for c in ends)
    assert_all_free(llm)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("cache", [False, True])
def test_aborting_child_0_before_its_prompt_is_done_releases_its_siblings(model, cache):
    prompt = prompt_of(37)
    params = SamplingParams(n=3, seed=6, temperature=1.0, max_tokens=5, ignore_eos=True)
    (expected,) = answers(make_llm(model, "split"), [{"prompt_token_ids": prompt}], params)
    llm = make_llm(model, "fork", cache=cache, max_num_batched_tokens=8)  # a 5-step prefill
    engine = llm.llm_engine
    parent = engine.add_request("g", prompt, params)
    first, *siblings = parent.child_requests
    engine.step()
    engine.step()
    assert 0 < first.num_computed_tokens < len(prompt) and "0_g" in engine.held
    engine.abort_request("0_g")
    assert first.status is RequestStatus.FINISHED_ABORTED and not engine.held
    step_until_done(engine)
    assert [c.num_output_tokens for c in siblings] == [5, 5]
    assert [c.output_token_ids for c in siblings] == expected[1:]  # each computed the prompt
    assert_all_free(llm)
    assert answers(llm, [{"prompt_token_ids": prompt}], params) == [expected]  # still works
    assert_all_free(llm)


@pytest.mark.parametrize("held", [False, True])
def test_closing_a_forked_stream_after_its_first_output_leaves_no_state(model, held):
    llm = make_llm(model, "fork", max_num_batched_tokens=16)
    forked = {"prompt_token_ids": prompt_of(40)}
    if held:  # a short prompt answers first, while the forked one's children are still held
        prompts = [{"prompt_token_ids": prompt_of(5, 2)}, forked]
        params = [SamplingParams(max_tokens=8), SamplingParams(n=4, max_tokens=8)]
    else:
        prompts, params = [forked], [SamplingParams(n=4, max_tokens=8)]
    stream = llm.stream(prompts, params)
    next(stream)
    assert bool(llm.llm_engine.held) is held
    stream.close()
    assert_all_free(llm)  # the pool, engine.held, engine.requests, engine.parent_requests
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_fork_respects_max_num_seqs(model):
    prompt = prompt_of(37)
    params = SamplingParams(n=5, seed=8, temperature=1.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(model, "fork", max_num_seqs=2)
    engine = llm.llm_engine
    parent = engine.add_request("g", prompt, params)
    peak = 0
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        assert len(engine.scheduler.running) <= 2
        peak = max(peak, len(engine.scheduler.running))
    assert not engine.has_unfinished_requests() and peak == 2
    assert [c.num_output_tokens for c in parent.child_requests] == [6] * 5
    # child 1 is forked; 2, 3 and 4 found no room, so each computed the prompt itself
    assert engine.stats()["num_computed_tokens"] == 4 * len(prompt) + 5 * 5
    (expected,) = answers(make_llm(model, "split"), [{"prompt_token_ids": prompt}], params)
    assert [c.output_token_ids for c in parent.child_requests] == expected  # fp32, same seeds
    assert_all_free(llm)


@pytest.mark.parametrize("kind", ["fork", "sub-block"])
def test_a_fault_in_the_copy_kernel_does_not_strand_copy_sources(model, monkeypatch, kind):
    from collections import Counter

    if kind == "fork":  # the children's first decode copies the shared, partial last block
        llm, prompt = make_llm(model, "fork"), prompt_of(37)
    else:  # a hit ending inside a block (at token 37 of 60 cached) copies it at admission
        llm, prompt = sub_block_llm(model, 1, blocks=64), prompt_of(60)
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    engine = llm.llm_engine
    manager = engine.scheduler.kv_cache_manager
    real, faults = minipaged.sharing.copy_blocks, []

    def faulty(kv_cache, src, dst, *args, **kwargs):
        if list(src) and not faults:  # once, in the first step with copies to make
            faults.append(list(src))
            raise RuntimeError("copy kernel fault")
        return real(kv_cache, src, dst, *args, **kwargs)

    monkeypatch.setattr(minipaged.sharing, "copy_blocks", faulty)
    tokens = prompt if kind == "fork" else prompt[:37] + [1, 2]
    engine.add_request("g", tokens, SamplingParams(n=3 if kind == "fork" else 1, max_tokens=6,
                                                   ignore_eos=True))
    with pytest.raises(RuntimeError, match="copy kernel fault"):
        step_until_done(engine)
    assert len(faults[0]) == (2 if kind == "fork" else 1)  # children 0 and 1 copy; 2 writes
    assert manager.blocks_to_copy == []
    # no block is held for a copy any more: each count is the number of tables holding it
    in_tables = Counter(b.block_id for t in manager.block_tables.values() for b in t.blocks)
    assert [b.ref_cnt for b in engine.pool.blocks] == [in_tables[b.block_id]
                                                      for b in engine.pool.blocks]
    engine.abort_request("g")
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks
    assert_all_free(llm)


@pytest.mark.parametrize("n", [1, 3])
def test_only_the_engine_abort_forgets_the_request(model, n):
    # Scheduler.abort_request is the low-level method: it takes a Request out of the queues,
    # returns its blocks and marks it aborted, and knows nothing of the engine's own records
    # (engine.requests, engine.parent_requests, a forking engine's held children).
    # LLMEngine.abort_request, by id, is the one callers use; only it forgets the request.
    params = SamplingParams(n=n, max_tokens=8)
    low_engine = make_llm(model, "split").llm_engine
    entry = low_engine.add_request("a", prompt_of(20), params)
    low_engine.step()
    for request in entry.child_requests if n > 1 else [entry]:
        low_engine.scheduler.abort_request(request)
        assert request.status is RequestStatus.FINISHED_ABORTED
        assert request not in low_engine.scheduler.running
        assert request.request_id not in low_engine.scheduler.kv_cache_manager.block_tables
    assert not low_engine.has_unfinished_requests()
    assert low_engine.pool.get_num_free_blocks() == low_engine.pool.num_blocks

    llm = make_llm(model, "split")
    entry = llm.llm_engine.add_request("a", prompt_of(20), params)
    llm.llm_engine.step()
    llm.llm_engine.abort_request("a")
    assert all(r.status is RequestStatus.FINISHED_ABORTED
               for r in (entry.child_requests if n > 1 else [entry]))
    assert_all_free(llm)  # engine.requests and engine.parent_requests are empty


def test_prefix_match_unit_through_the_package_llm(model):
    llm = LLM(model=model, max_model_len=MAX_LEN, num_gpu_blocks_override=64,
              prefix_match_unit=4)  # the prefix cache is on by default
    assert type(llm.llm_engine.scheduler.kv_cache_manager) is SubBlockPrefixCachingKVCacheManager
    first = prompt_of(60)
    second = first[:42] + [first[42] + 1, 2, 3]  # agrees on 42 tokens: 2 blocks and 10
    greedy = SamplingParams(temperature=0, max_tokens=3)
    llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)
    (out,) = llm.generate({"prompt_token_ids": second}, greedy, use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["sub_block_tokens"] == 8 > 0  # 10 rounded down to the unit
    assert stats["prefix_cache_hits"] == 32
    (plain,) = make_llm(model, "split").generate({"prompt_token_ids": second}, greedy,
                                                  use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_all_free(llm)
    for bad in (dict(prefix_match_unit=3), dict(prefix_match_unit=4, enable_prefix_caching=False)):
        with pytest.raises(ValueError, match="prefix_match_unit"):
            LLM(model=model, max_model_len=MAX_LEN, num_gpu_blocks_override=64, **bad)
