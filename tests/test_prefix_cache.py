"""Prefix caching (chapter 8): the hash, the pool's map and eviction order, the manager's lookups,
the two chapter-7 fixes it needed, and the engine with the cache on against the cache off."""
import hashlib
import struct

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minipaged import LLM, SamplingParams
from minipaged.blocks import BlockPool, BlockTable
from minipaged.model import ModelConfig, random_model
from minipaged.prefix_cache import (
    NONE_HASH,
    PrefixCachingBlockPool,
    PrefixCachingKVCacheManager,
    encode_extra_key,
    generate_block_hash_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from minipaged.scheduler import KVCacheManager, Request, Scheduler

# --- the hash -----------------------------------------------------------------------------


FIRST_DIGEST = "4dbe8f188cc357475a7e1c3a7ee793eacf91f053bb375065ddf3bc04eff0e6c2"
SALTED_DIGEST = "a6b8a98ede45cb316387ff21eb2a8f9708562d633707064f56db5db0feca5897"


def test_fixed_digests_for_fixed_inputs():
    # These digests must never change: they are the cache's identity across processes,
    # machines and versions. Changing the encoding means changing these on purpose.
    assert NONE_HASH.hex() == hashlib.sha256(b"minipaged: the parent of a first block").hexdigest()
    first = hash_block_tokens(None, list(range(16)))
    assert first.hex() == FIRST_DIGEST
    assert hash_block_tokens(first, [5] * 16, (("cache_salt", "a"),)).hex() == SALTED_DIGEST
    # and they are SHA-256 of exactly the documented layout
    layout = NONE_HASH + struct.pack("<17I", 16, *range(16)) + b"t" + struct.pack("<I", 0)
    assert hashlib.sha256(layout).hexdigest() == FIRST_DIGEST


def test_the_encoding_is_the_documented_layout():
    assert encode_extra_key(()) == b"t" + struct.pack("<I", 0)
    assert encode_extra_key("ab") == b"s" + struct.pack("<I", 2) + b"ab"
    assert encode_extra_key(b"\x01") == b"b" + struct.pack("<I", 1) + b"\x01"
    assert encode_extra_key(3) == b"i" + (3).to_bytes(16, "little", signed=True)
    # tags and lengths keep different key tuples apart
    assert encode_extra_key(("ab", "c")) != encode_extra_key(("a", "bc"))
    assert encode_extra_key((1,)) != encode_extra_key(("1",))


@pytest.mark.heavy  # a subprocess or a scratch repository: seconds
def test_the_hash_is_the_same_in_another_process():
    import subprocess
    import sys

    script = ("from minipaged.prefix_cache import hash_block_tokens; "
              "print(hash_block_tokens(None, list(range(16)), (('cache_salt', 'x'),)).hex())")
    outs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, env={**__import__("os").environ, "PYTHONHASHSEED": seed}
                           ).stdout for seed in ("1", "2")}
    assert len(outs) == 1


@pytest.mark.parametrize("keys", [(("cache_salt", "a"),), (("cache_salt", "b"),),
                                  (("lora", "adapter-1"),), (("mm", b"\x00" * 32),), (7,)])
def test_extra_keys_change_the_hash(keys):
    tokens = list(range(16))
    assert hash_block_tokens(None, tokens, keys) != hash_block_tokens(None, tokens)
    # and through the chain, every later block
    parent_plain, parent_keyed = hash_block_tokens(None, tokens), hash_block_tokens(None, tokens,
                                                                                     keys)
    assert hash_block_tokens(parent_plain, tokens) != hash_block_tokens(parent_keyed, tokens)


def test_the_parent_changes_the_hash():
    a, b = hash_block_tokens(None, [1] * 16), hash_block_tokens(None, [2] * 16)
    assert hash_block_tokens(a, [3] * 16) != hash_block_tokens(b, [3] * 16)
    assert hash_block_tokens(None, [3] * 16) == hash_block_tokens(NONE_HASH, [3] * 16)


@pytest.mark.parametrize("call, field", [
    (lambda: hash_block_tokens(b"short", [1]), "parent_block_hash"),
    (lambda: hash_block_tokens(None, [-1]), "token_ids"),
    (lambda: hash_block_tokens(None, [2**32]), "token_ids"),
    (lambda: hash_block_tokens(None, [1], ["list"]), "extra_keys"),
    (lambda: hash_block_tokens(None, [1], (1.5,)), "extra_keys"),
    (lambda: hash_block_tokens(None, [1], (None,)), "extra_keys"),
    (lambda: hash_block_tokens(None, [1], (True,)), "extra_keys"),
])
def test_bad_hash_inputs_name_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_salt_enters_the_first_block_only_and_only_full_blocks_are_hashed():
    salted = Request("s", list(range(40)), SamplingParams(), cache_salt="tenant")
    plain = Request("p", list(range(40)), SamplingParams())
    assert generate_block_hash_extra_keys(salted, 0) == (("cache_salt", "tenant"),)
    assert generate_block_hash_extra_keys(salted, 16) == ()
    salted_hashes, plain_hashes = update_block_hashes(salted, 16), update_block_hashes(plain, 16)
    assert len(salted_hashes) == len(plain_hashes) == 2  # 40 tokens: two full blocks
    assert all(a != b for a, b in zip(salted_hashes, plain_hashes))  # the chain carries it
    plain.append_output_token(1)
    assert len(update_block_hashes(plain, 16)) == 2
    for token in range(7):
        plain.append_output_token(token)
    assert len(update_block_hashes(plain, 16)) == 3  # generated tokens fill blocks too
    assert plain.block_hashes[2] == hash_block_tokens(plain.block_hashes[1],
                                                      plain.all_token_ids[32:48])


# --- the pool -------------------------------------------------------------------------------


def test_freed_blocks_keep_their_hash_and_uncached_ones_are_reused_first():
    pool = PrefixCachingBlockPool(num_blocks=6, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(10)  # blocks 0, 1 full; 2 partial
    hashes = [hash_block_tokens(None, [1, 2, 3, 4])]
    hashes.append(hash_block_tokens(hashes[0], [5, 6, 7, 8]))
    pool.cache_full_blocks(table.blocks, hashes, 0, 2)
    table.free()
    order = [b.block_id for b in pool.free_block_queue]
    assert order == [2, 3, 4, 5, 1, 0]  # the partial block first, cached tail first at the back
    assert pool.get_cached_block(hashes[0]) is pool.blocks[0]
    fresh = BlockTable(pool)
    fresh.ensure_capacity(16)  # four blocks: 2, 3, 4, 5, no eviction
    assert pool.num_evictions == 0 and len(pool.cached_block_hash_to_block) == 2
    fresh.ensure_capacity(20)  # a fifth: evicts block 1, the tail of the prefix
    assert fresh.blocks[-1].block_id == 1 and pool.num_evictions == 1
    assert pool.get_cached_block(hashes[1]) is None and pool.blocks[1].block_hash is None
    assert pool.get_cached_block(hashes[0]) is pool.blocks[0]


def test_a_hit_on_a_free_block_takes_it_out_of_the_queue():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(4)
    digest = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks(table.blocks, [digest], 0, 1)
    table.free()
    assert pool.get_num_free_blocks() == 4
    other = BlockTable(pool)
    other.share([pool.get_cached_block(digest)])
    assert pool.get_num_free_blocks() == 3 and pool.blocks[0].ref_cnt == 1
    assert 0 not in [b.block_id for b in pool.free_block_queue]


def test_duplicates_stay_private():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    a, b = BlockTable(pool), BlockTable(pool)
    a.ensure_capacity(4)
    b.ensure_capacity(4)
    digest = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_full_blocks(a.blocks, [digest], 0, 1)
    pool.cache_full_blocks(b.blocks, [digest], 0, 1)
    assert pool.get_cached_block(digest) is a.blocks[0] and b.blocks[0].block_hash is None


def test_reset_prefix_cache_refuses_while_blocks_are_held():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(4)
    pool.cache_full_blocks(table.blocks, [hash_block_tokens(None, [1, 2, 3, 4])], 0, 1)
    assert pool.reset_prefix_cache() is False and len(pool.cached_block_hash_to_block) == 1
    table.free()
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)


# --- the manager and the two chapter-7 fixes ---------------------------------------------------


def _admit(manager, request):
    blocks, tokens = manager.get_computed_blocks(request)
    ok = manager.can_admit(request, blocks) and manager.allocate_slots(
        request, request.num_tokens - tokens, blocks) is not None
    if ok:
        request.num_computed_tokens = request.num_tokens  # as if the step had run
    return ok, blocks, tokens


def test_a_full_prompt_hit_still_computes_the_last_token():
    manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(num_blocks=400, block_size=16))
    prompt = list(range(2407))
    first, second = Request("a", prompt, SamplingParams()), Request("b", prompt, SamplingParams())
    assert _admit(manager, first)[0]
    ok, blocks, tokens = _admit(manager, second)
    assert ok and len(blocks) == 150 and tokens == 2400
    aligned = Request("c", list(range(2400)), SamplingParams())
    assert manager.get_computed_blocks(aligned)[1] == 2384  # 2,399 rounded down to a block
    assert manager.stats()["prefix_cache_hits"] == 2400


def test_a_refused_allocation_changes_nothing():
    # Chapter 7 raised the hit blocks' counts before the capacity check; a refusal leaked them.
    pool = PrefixCachingBlockPool(num_blocks=6, block_size=4)
    manager = PrefixCachingKVCacheManager(pool)
    first = Request("a", list(range(12)), SamplingParams())
    assert _admit(manager, first)[0]
    manager.free(first)  # three cached blocks, all free
    later = Request("b", list(range(12)) + list(range(100, 120)), SamplingParams())
    blocks, tokens = manager.get_computed_blocks(later)
    assert len(blocks) == 3
    counts = [b.ref_cnt for b in pool.blocks]
    free, queue = pool.get_num_free_blocks(), [b.block_id for b in pool.free_block_queue]
    assert not manager.can_admit(later, blocks)  # 8 blocks wanted, 6 in the pool
    assert manager.allocate_slots(later, later.num_tokens - tokens, blocks) is None
    assert [b.ref_cnt for b in pool.blocks] == counts and pool.get_num_free_blocks() == free
    assert [b.block_id for b in pool.free_block_queue] == queue
    assert later.request_id not in manager.block_tables


def test_free_hit_blocks_count_as_capacity_they_use_up():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    manager = PrefixCachingKVCacheManager(pool)
    first = Request("a", list(range(9)), SamplingParams())
    assert _admit(manager, first)[0]
    manager.free(first)  # blocks 0, 1 cached and free; 2 free
    later = Request("b", list(range(8)) + [50] * 9, SamplingParams())  # 17 tokens: 5 blocks
    blocks, _ = manager.get_computed_blocks(later)
    assert len(blocks) == 2
    # 2 hits + 3 new = 5 blocks > 4: refused although 3 new ones would fit the 4 free
    assert manager.get_num_blocks_to_allocate(later, later.num_tokens, blocks) == 5
    assert not manager.can_admit(later, blocks)


def test_the_plain_manager_is_unchanged_without_hits():
    manager = KVCacheManager(BlockPool(num_blocks=4, block_size=16))
    request = Request("r", list(range(70)), SamplingParams())
    assert not manager.can_admit(request) and manager.allocate_slots(request, 70) is None
    assert manager.block_tables == {}


# --- a stateful property test over requests that share and diverge ----------------------------


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions, growth, finishes and preemptions through the real scheduler."""

    def __init__(self):
        super().__init__()
        self.pool = PrefixCachingBlockPool(num_blocks=12, block_size=4)
        self.manager = PrefixCachingKVCacheManager(self.pool)
        self.scheduler = Scheduler(self.manager, max_num_batched_tokens=16, max_num_seqs=4,
                                   max_model_len=40)
        self.next_id = 0
        self.tokens_of_block: dict[int, tuple] = {}

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9)]),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9),
          salt=st.sampled_from([None, None, "x"]))
    def add(self, prefix, tail, salt):
        if len(self.scheduler.waiting) + len(self.scheduler.running) >= 6:
            return
        request = Request(str(self.next_id), list(prefix) + tail,
                          SamplingParams(max_tokens=6, ignore_eos=True), cache_salt=salt)
        self.next_id += 1
        self.scheduler.add_request(request)

    @precondition(lambda self: self.scheduler.has_unfinished_requests())
    @rule(token=st.integers(0, 3))
    def step(self, token):
        out = self.scheduler.schedule()
        # every block the step will fill holds, in the map, exactly the tokens of its hash
        sampled = {r.request_id: token for r in out.scheduled_requests
                   if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                   == r.num_tokens}
        self.scheduler.update_from_output(out, sampled)

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler.abort_request(request)

    @invariant()
    def counts_equal_holders(self):
        holders = [0] * self.pool.num_blocks
        for table in self.manager.block_tables.values():
            for block in table.blocks:
                holders[block.block_id] += 1
        assert [b.ref_cnt for b in self.pool.blocks] == holders
        free = {b.block_id for b in self.pool.free_block_queue}
        assert free == {i for i, h in enumerate(holders) if h == 0}
        assert len(free) == self.pool.get_num_free_blocks()

    @invariant()
    def the_map_is_consistent(self):
        free = {b.block_id for b in self.pool.free_block_queue}
        for digest, block in self.pool.cached_block_hash_to_block.items():
            assert block.block_hash == digest
            assert block.ref_cnt > 0 or block.block_id in free
        hashed = [b for b in self.pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(self.pool.cached_block_hash_to_block)  # evicted blocks left it

    @invariant()
    def no_hash_points_at_other_tokens(self):
        # each held block's hash is the hash its holder computes for that position
        for request in self.scheduler.running:
            table = self.manager.block_tables.get(request.request_id)
            if table is None:
                continue
            hashes = update_block_hashes(request, 4)
            for index, block in enumerate(table.blocks):
                if block.block_hash is not None:
                    assert index < len(hashes) and block.block_hash == hashes[index]

    @invariant()
    def free_queue_puts_every_uncached_block_before_every_cached_one(self):
        cached = [b.block_hash is not None for b in self.pool.free_block_queue]
        assert cached == sorted(cached)


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.pytestmark = [pytest.mark.heavy]  # a stateful search: over a second


def test_different_salts_never_share_a_block():
    manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(num_blocks=40, block_size=4))
    prompt = list(range(20))
    owners = {}
    for index, salt in enumerate([None, "a", "b", "a", None]):
        request = Request(str(index), prompt, SamplingParams(), cache_salt=salt)
        assert _admit(manager, request)[0]
        for block in manager.get_block_table(request).blocks:
            owners.setdefault(block.block_id, set()).add(salt)
    assert all(len(salts) == 1 for salts in owners.values())
    assert manager.stats()["prefix_cache_hits"] == 2 * 16  # the second "a" and the second None


# --- the engine: the cache changes no answer ------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=2), seed=0)


@pytest.mark.heavy
@pytest.mark.parametrize("blocks", [256, 14])
def test_greedy_answers_are_identical_with_the_cache_on_and_off(model, blocks):
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 512, (37,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(0, 512, (n,), generator=gen).tolist()}
               for n in (1, 5, 9, 3, 12, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    answers, stats = {}, {}
    for on in (False, True):
        llm = LLM(model=model, max_model_len=128, num_gpu_blocks_override=blocks,
                  enable_prefix_caching=on)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        answers[on] = [o.outputs[0].token_ids for o in outputs]
        stats[on] = llm.llm_engine.stats()
        pool = llm.llm_engine.pool
        assert pool.get_num_free_blocks() == pool.num_blocks  # nothing leaked
        if on:
            assert sum(o.num_cached_tokens for o in outputs) > 0
            assert llm.reset_prefix_cache()
    assert answers[False] == answers[True]
    assert stats[True]["num_computed_tokens"] < stats[False]["num_computed_tokens"]


@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_num_cached_tokens_and_reset_through_llm(model):
    llm = LLM(model=model, max_model_len=128, num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": list(range(40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    first, second = (llm.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    stats = llm.llm_engine.stats()
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (80, 32)
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    off = LLM(model=model, max_model_len=128, num_gpu_blocks_override=64,
              enable_prefix_caching=False)
    assert off.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert "prefix_cache_hits" not in off.llm_engine.stats()


def test_blocks_cached_for_a_step_that_never_ran_are_forgotten_on_free():
    pool = PrefixCachingBlockPool(num_blocks=8, block_size=4)
    manager = PrefixCachingKVCacheManager(pool)
    request = Request("a", list(range(12)), SamplingParams())
    assert manager.allocate_slots(request, 12) is not None  # cached at allocation: 3 full blocks
    assert len(pool.cached_block_hash_to_block) == 3
    manager.free(request)  # withdrawn before the model ran: num_computed_tokens is still 0
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    done = Request("b", list(range(12)), SamplingParams())
    assert manager.allocate_slots(done, 12) is not None
    done.num_computed_tokens = 12  # the step ran
    manager.free(done)
    assert len(pool.cached_block_hash_to_block) == 3  # what it computed stays findable


def test_decoding_caches_each_block_at_the_step_it_fills_and_hashes_nothing_between(monkeypatch):
    import minipaged.prefix_cache as prefix_cache

    calls = []
    real = prefix_cache.update_block_hashes
    monkeypatch.setattr(prefix_cache, "update_block_hashes",
                        lambda request, size: calls.append(request.num_tokens) or real(request,
                                                                                       size))
    pool = PrefixCachingBlockPool(num_blocks=16, block_size=4)
    manager = PrefixCachingKVCacheManager(pool)
    request = Request("a", [1, 2, 3], SamplingParams())
    assert manager.allocate_slots(request, 3) is not None
    request.num_computed_tokens = 3
    for token in range(10, 24):  # one token a step, as a decode does
        request.append_output_token(token)
        calls.clear()
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        filled = request.num_computed_tokens % 4 == 0
        assert len(calls) == (1 if filled else 0)
        assert manager.num_cached_block["a"] == request.num_computed_tokens // 4
        assert len(pool.cached_block_hash_to_block) == request.num_computed_tokens // 4
    table = manager.get_block_table(request)
    assert [b.block_hash for b in table.blocks[:4]] == request.block_hashes[:4]


def test_prepend_n_keeps_the_given_order_at_the_head():
    # vLLM's FreeKVCacheBlockQueue.prepend_n: the first block given ends at the very head
    from minipaged.blocks import KVCacheBlock
    from minipaged.prefix_cache import EvictionOrderQueue

    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = EvictionOrderQueue(blocks[:3])
    queue.prepend_n(blocks[3:])
    assert [b.block_id for b in queue] == [3, 4, 5, 0, 1, 2] and len(queue) == 6
    assert all(b.free_queue is queue for b in blocks)
    assert queue.popleft_n(6) == blocks[3:] + blocks[:3]
    queue.prepend_n([])
    assert len(queue) == 0 and list(queue) == []


def test_hashless_blocks_freed_in_one_call_reach_the_head_in_the_order_given():
    pool = PrefixCachingBlockPool(num_blocks=6, block_size=4)
    taken = pool.get_new_blocks(3)
    pool.free_blocks(taken)  # none has a hash: all to the head, keeping the given order
    assert [b.block_id for b in pool.free_block_queue][:3] == [b.block_id for b in taken]


def test_a_block_freed_twice_in_one_call_moves_to_the_head_once():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    shared, other = pool.get_new_blocks(2)
    pool.touch([shared])  # two owners, both given back in one call
    pool.free_blocks([other, shared, shared])
    order = [b.block_id for b in pool.free_block_queue]
    assert order == [other.block_id, shared.block_id, 2, 3] and len(pool.free_block_queue) == 4
    assert shared.ref_cnt == other.ref_cnt == 0


def test_an_overdrawn_light_release_puts_every_count_back_in_the_prefix_pool():
    pool = PrefixCachingBlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(8)
    pool.free_blocks(table.blocks[1:])  # block 1 freed behind the table's back
    before = [b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue]
    with pytest.raises(ValueError, match="block 1 is freed more often than held"):
        table.free()
    assert ([b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue]) == before


def test_a_readmitted_request_counts_only_under_preempted_as_in_vllm():
    """Admit, preempt, readmit one request: vLLM's PrefixCacheStats.record counts the first
    admission in requests/queries/hits and the return in preempted_* alone."""
    manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(8, 16))
    request = Request("r", list(range(20)), SamplingParams(temperature=0))
    blocks, hits = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hits, blocks) is not None
    request.num_computed_tokens = request.num_tokens  # the model ran: its full block is cached
    manager.free(request)
    request.num_computed_tokens, request.num_preemptions = 0, 1  # chapter 7's preemption
    blocks, hits = manager.get_computed_blocks(request)
    assert hits == 16 and manager.allocate_slots(request, request.num_tokens - hits, blocks)
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (1, 20, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 20, 16)


def test_parallel_sampling_reports_the_last_childs_cached_tokens_as_vllm():
    """n=2 on one prompt: the second child finds the first's full prompt block in the cache.
    vLLM 0.29.0's RequestOutput carries the num_cached_tokens of the child that completed the
    prompt (the last to finish), so the output reports that hit, as stats() counts it."""
    llm = LLM(seed=0, max_model_len=128, kv_cache_memory_bytes=2**20)
    prompt = {"prompt_token_ids": list(range(1, 18)), "cache_salt": "a"}
    (out,) = llm.generate([prompt], SamplingParams(n=2, max_tokens=4, seed=0), use_tqdm=False)
    assert llm.llm_engine.stats()["prefix_cache_hits"] == 16
    assert out.num_cached_tokens == 16
