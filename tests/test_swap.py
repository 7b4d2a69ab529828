"""Preemption by swap (chapter 11): byte-exact round trips, the scheduling policy, the fallback to
recompute, composition with the prefix cache, and the engine's answers against recompute's."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import LLM, SamplingParams
from minipaged.blocks import BlockPool
from minipaged.engine import LLMEngine
from minipaged.kv_cache import KVCache
from minipaged.model import ModelConfig, random_model
from minipaged.prefix_cache import PrefixCachingBlockPool, PrefixCachingKVCacheManager
from minipaged.scheduler import KVCacheManager, Request, RequestStatus, Scheduler, needs_sample
from minipaged.swap import HostKVCache, SwappingEngine, SwapScheduler, SwapSchedulerOutput


def step(scheduler, token=0):
    """Schedule one step and book it, every sampled token being `token`; return the output."""
    out = scheduler.schedule()
    scheduler.update_from_output(out, {r.request_id: token for r in out.scheduled_requests
                                       if needs_sample(r, out.num_scheduled_tokens[r.request_id])})
    return out


def swap_blocks(scheduler, out, cache):
    """What SwappingEngine.execute does before the forward pass: out to the host, then in."""
    scheduler.host.swap_out_blocks(cache, out.blocks_to_swap_out)
    scheduler.host.swap_in_blocks(cache, out.blocks_to_swap_in)


def random_cache(num_blocks, block_size, seed=0):
    cache = KVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2,
                    head_dim=4)
    gen = torch.Generator().manual_seed(seed)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    return cache


# --- the host pool and its copies -----------------------------------------------------------


def test_host_pool_has_the_cache_layout_and_its_own_free_queue():
    cache = random_cache(8, 4)
    host = HostKVCache(num_blocks=3, block_size=4)
    assert host.layers == []  # no memory until the first swap-out
    host.swap_out_blocks(cache, [(5, 2)])
    assert [tuple(layer.shape) for layer in host.layers] == [(3, *cache.layers[0].shape[1:])] * 2
    assert all(h.dtype == c.dtype for h, c in zip(host.layers, cache.layers))
    assert host.pool.get_num_free_blocks() == 3  # copies do not allocate: the scheduler does
    assert host.num_bytes_swapped_out == HostKVCache.bytes_per_block(cache) == 2 * 2 * 4 * 8 * 4


def test_bad_mappings_are_refused_before_any_copy():
    cache = random_cache(8, 4)
    host = HostKVCache(num_blocks=3, block_size=4)
    host.swap_out_blocks(cache, [(0, 0)])
    before = [layer.clone() for layer in host.layers]
    for mapping in ([(8, 0)], [(0, 3)], [(-1, 0)], [(1, 0), (2, 0)]):
        with pytest.raises(ValueError, match="mapping"):
            host.swap_out_blocks(cache, mapping)
    # the pool is unfilled memory (torch.empty): compare its bytes, since a NaN never equals itself
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, host.layers))
    assert host.num_bytes_swapped_out == HostKVCache.bytes_per_block(cache)
    with pytest.raises(ValueError, match="block_size"):
        HostKVCache(3, 2).swap_out_blocks(cache, [(0, 0)])


# --- the property: a swap-out then a swap-in restores the same bytes ---------------------------


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4]),
       prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 12)), min_size=1, max_size=5),
       num_steps=st.integers(1, 4), victim_index=st.integers(0, 4), caching=st.booleans(),
       seed=st.integers(0, 2**16))
def test_swap_out_then_in_restores_byte_identical_blocks(block_size, prompts, num_steps,
                                                         victim_index, caching, seed):
    num_blocks = 160  # room for every request at once: nobody is preempted while they grow
    if caching:
        manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(num_blocks, block_size))
    else:
        manager = KVCacheManager(BlockPool(num_blocks, block_size))
    scheduler = SwapScheduler(manager, max_num_batched_tokens=256, num_cpu_blocks=80)
    cache = random_cache(num_blocks, block_size, seed)
    prefixes = [[7] * 9, [3, 1, 4, 1, 5, 9, 2, 6], []]  # shared openings: blocks found by hash
    for i, (prefix, tail_len) in enumerate(prompts):
        tokens = prefixes[prefix] + [(seed + i * 31 + j) % 500 for j in range(tail_len)]
        scheduler.add_request(Request(str(i), tokens, SamplingParams(max_tokens=50)))
    for _ in range(num_steps):
        step(scheduler)
    assert scheduler.num_preemptions == 0
    victim = scheduler.running[victim_index % len(scheduler.running)]
    num_saved = math.ceil(victim.num_computed_tokens / block_size)
    saved_ids = manager.get_block_table(victim).block_ids[:num_saved]
    saved = [layer[saved_ids].clone() for layer in cache.layers]
    others = {rid: t.block_ids for rid, t in manager.block_tables.items()
              if rid != victim.request_id}
    shared_before = [b for b in saved_ids if manager.pool.blocks[b].ref_cnt > 1]

    out = SwapSchedulerOutput([], {}, [])
    scheduler.running.remove(victim)
    scheduler.preempt(victim, out)
    assert out.preempted_requests == [victim] and scheduler.num_swap_fallbacks == 0
    assert victim in scheduler.swapped and victim.request_id not in manager.block_tables
    assert [d for d, _ in out.blocks_to_swap_out] == saved_ids  # every block, shared ones too
    swap_blocks(scheduler, out, cache)
    for block_id in shared_before:  # a shared block keeps its other owners
        assert manager.pool.blocks[block_id].ref_cnt >= 1
    free_ids = [b.block_id for b in manager.pool.free_block_queue]
    for layer in cache.layers:  # whatever is free may be overwritten by someone else meanwhile
        layer[free_ids] = float("nan")

    back = SwapSchedulerOutput([], {}, [])
    scheduler.swapped.remove(victim)
    assert scheduler.swap_in(victim, back, 256) > 0
    swap_blocks(scheduler, back, cache)
    restored_ids = manager.get_block_table(victim).block_ids[:num_saved]
    assert [d for _, d in back.blocks_to_swap_in] == restored_ids
    assert all(torch.equal(layer[restored_ids], s) for layer, s in zip(cache.layers, saved))
    # the restored blocks are the victim's own: no other request holds any of them
    assert not set(restored_ids) & {b for ids in others.values() for b in ids}
    assert scheduler.host.pool.get_num_free_blocks() == scheduler.host.pool.num_blocks
    assert all(b.block_hash is None for b in scheduler.host.pool.blocks)  # nothing found in host
    for request in scheduler.running + [victim]:  # and then nothing leaks from the device pool
        manager.free(request)
    assert manager.pool.get_num_free_blocks() == manager.pool.num_blocks


# --- the policy ----------------------------------------------------------------------------


def toy_scheduler(answers, device_blocks=7, host_blocks=6):
    scheduler = SwapScheduler(KVCacheManager(BlockPool(device_blocks, block_size=4)),
                              max_num_batched_tokens=32, num_cpu_blocks=host_blocks)
    for name, answer in answers.items():
        scheduler.add_request(Request(name, [1] * 7, SamplingParams(max_tokens=answer,
                                                                    ignore_eos=True)))
    return scheduler


def test_swapped_requests_resume_before_new_admissions():
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6))
    swapped_while_d_waited, admitted_d_at, steps = set(), None, 0
    while scheduler.has_unfinished_requests():
        waiting_before = list(scheduler.waiting)
        out = step(scheduler)
        steps += 1
        admitted = [r for r in out.scheduled_requests if r in waiting_before]
        if admitted:  # admissions only in a step that preempted nobody and left nobody swapped
            assert not out.preempted_requests and not scheduler.swapped
        if out.blocks_to_swap_in:  # no swap-in in a step that preempted
            assert not out.preempted_requests and not out.blocks_to_swap_out
        if any(r.request_id == "D" for r in admitted):
            admitted_d_at = steps
        if admitted_d_at is None:
            swapped_while_d_waited |= {r.request_id for r in scheduler.swapped}
    assert "C" in swapped_while_d_waited and admitted_d_at is not None
    assert scheduler.num_swap_outs == scheduler.num_swap_ins >= 2
    assert scheduler.kv_cache_manager.pool.get_num_free_blocks() == 7
    assert scheduler.host.pool.get_num_free_blocks() == 6 and not scheduler.host_tables


def test_a_swapped_request_keeps_its_computed_tokens():
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6))
    while not scheduler.swapped:
        step(scheduler)
    victim = scheduler.swapped[0]
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens > 0
    kept = victim.num_computed_tokens
    while victim in scheduler.swapped:
        out = step(scheduler)
    assert out.num_scheduled_tokens[victim.request_id] == 1  # it goes on decoding, no prefill
    assert victim.num_computed_tokens == kept + 1


def test_a_full_host_pool_falls_back_to_recompute():
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6), host_blocks=1)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.num_swap_fallbacks > 0 and scheduler.num_swap_outs == 0
    assert scheduler.num_preemptions == scheduler.num_swap_fallbacks
    assert scheduler.kv_cache_manager.pool.get_num_free_blocks() == 7


def test_a_fallback_is_booked_once_in_the_steps_output():
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6), host_blocks=1)
    while not scheduler.num_swap_fallbacks:
        out = step(scheduler)
    (victim,) = out.preempted_requests  # recorded by chapter 7's preempt, not twice
    assert victim in scheduler.waiting and victim.num_computed_tokens == 0
    assert not out.blocks_to_swap_out and not scheduler.swapped


def test_aborting_a_swapped_request_returns_its_host_blocks():
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6))
    while not scheduler.swapped:
        step(scheduler)
    victim = scheduler.swapped[0]
    scheduler.abort_request(victim)
    assert victim.status is RequestStatus.FINISHED_ABORTED and victim not in scheduler.swapped
    assert scheduler.host.pool.get_num_free_blocks() == 6 and not scheduler.host_tables


def test_num_cpu_blocks_is_checked_and_fixed_while_requests_are_swapped_out():
    manager = KVCacheManager(BlockPool(7, 4))
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        SwapScheduler(manager, num_cpu_blocks=0)
    assert SwapScheduler(manager).host.pool.num_blocks == 7  # default: the device pool's size
    scheduler = toy_scheduler(dict(A=4, B=12, C=12, D=6))
    while not scheduler.swapped:
        step(scheduler)
    host = scheduler.host
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        scheduler.set_num_cpu_blocks(10)
    assert scheduler.host is host


def test_prefix_cached_blocks_on_swap_out_and_in():
    manager = PrefixCachingKVCacheManager(PrefixCachingBlockPool(12, 4))
    scheduler = SwapScheduler(manager, max_num_batched_tokens=64, num_cpu_blocks=8)
    shared = list(range(10, 18))
    for name, tail in [("A", [1, 2, 3, 4, 5]), ("B", [7, 8, 9, 6, 5])]:
        scheduler.add_request(Request(name, shared + tail, SamplingParams(max_tokens=4)))
        step(scheduler)
    a, b = scheduler.running
    a_ids, b_ids = manager.get_block_table(a).block_ids, manager.get_block_table(b).block_ids
    assert a_ids[:2] == b_ids[:2]  # found by hash
    out = SwapSchedulerOutput([], {}, [])
    scheduler.running.remove(b)
    scheduler.preempt(b, out)
    assert out.preempted_requests == [b]
    assert [d for d, _ in out.blocks_to_swap_out] == b_ids  # shared blocks are copied too
    assert [manager.pool.blocks[i].ref_cnt for i in a_ids[:2]] == [1, 1]  # A keeps them
    own_full = manager.pool.blocks[b_ids[2]]
    assert own_full.ref_cnt == 0 and own_full.block_hash is not None  # still findable
    back = SwapSchedulerOutput([], {}, [])
    scheduler.swapped.remove(b)
    scheduler.swap_in(b, back, 64)
    new_ids = manager.get_block_table(b).block_ids
    assert not set(new_ids) & set(a_ids) and b_ids[2] not in new_ids  # private, fresh blocks
    assert all(manager.pool.blocks[i].block_hash is None for i in new_ids)  # duplicates
    assert manager.prefix_cache_stats.requests == 2  # a swap-in is not an admission


# --- the engine ----------------------------------------------------------------------------


@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_preemption_mode_through_llm():
    from minipaged.llm import ENGINE_CLASSES, SCHEDULER_CLASSES

    assert SCHEDULER_CLASSES == {"recompute": Scheduler, "swap": SwapScheduler}
    assert ENGINE_CLASSES["swap", None] is SwappingEngine
    assert ENGINE_CLASSES["recompute", None] is LLMEngine
    llm = LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap")
    assert type(llm.llm_engine.scheduler) is SwapScheduler
    assert type(llm.llm_engine) is SwappingEngine
    recompute = LLM(max_model_len=64, num_gpu_blocks_override=8).llm_engine
    assert type(recompute.scheduler) is Scheduler and type(recompute) is LLMEngine
    for bad in ("Swap", "", None, ["swap"]):
        with pytest.raises(ValueError, match="preemption_mode"):
            LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode=bad)


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=2), seed=0)


@pytest.mark.heavy
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_answers_equal_recompute_and_an_ample_pool(model, caching, sampling):
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 512, (20,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": prefix + torch.randint(0, 512, (n,), generator=gen).tolist()}
               for n in (1, 4, 9, 2, 7, 5, 3, 8)]
    if sampling == "greedy":
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    else:
        params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=40,
                                 ignore_eos=True) for i in range(len(prompts))]
    answers, engines = {}, {}
    for name, blocks, mode, host in [("ample", 64, "recompute", None),
                                     ("recompute", 14, "recompute", None),
                                     ("swap", 14, "swap", None),
                                     ("swap, full host pool", 14, "swap", 4)]:
        llm = LLM(model=model, max_model_len=128, num_gpu_blocks_override=blocks,
                  enable_prefix_caching=caching, preemption_mode=mode)
        if host is not None:
            llm.llm_engine.scheduler.set_num_cpu_blocks(host)
        answers[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                     use_tqdm=False)]
        engine = engines[name] = llm.llm_engine
        assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks  # no leak
        if mode == "swap":
            scheduler = engine.scheduler
            assert scheduler.host.pool.get_num_free_blocks() == scheduler.host.pool.num_blocks
            assert not scheduler.swapped and not scheduler.host_tables
    assert answers["recompute"] == answers["ample"] == answers["swap"] \
        == answers["swap, full host pool"]
    swapping, falling_back = engines["swap"].scheduler, engines["swap, full host pool"].scheduler
    assert swapping.num_swap_outs > 0 and swapping.num_swap_fallbacks == 0
    assert swapping.host.num_bytes_swapped_out == swapping.host.num_bytes_swapped_in > 0
    assert falling_back.num_swap_fallbacks > 0
    # swap computes no token twice: exactly the ample pool's work, unlike recompute
    stats = {name: engine.stats()["num_computed_tokens"] for name, engine in engines.items()}
    if not caching:
        assert stats["swap"] == stats["ample"] < stats["recompute"]


def test_the_swapping_engine_needs_a_swap_scheduler(model):
    engine = SwappingEngine(model, 8, max_model_len=64, scheduler_cls=SwapScheduler,
                            swap_space=0.001)
    assert type(engine.scheduler) is SwapScheduler
    assert engine.scheduler.block_bytes == HostKVCache.bytes_per_block(engine.kv_cache)
    with pytest.raises(ValueError, match="SwapScheduler"):
        SwappingEngine(model, 8, max_model_len=64)
    with pytest.raises(ValueError, match="engine_cls"):  # the package's LLM chooses classes
        LLM(model=model, max_model_len=64, num_gpu_blocks_override=8, engine_cls=SwappingEngine)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_the_engine_makes_the_steps_swaps_before_its_forward_pass(model, monkeypatch):
    calls = []
    engine = SwappingEngine(model, 8, max_model_len=64, scheduler_cls=SwapScheduler,
                            swap_space=0.001)
    host = engine.scheduler.host
    for name in ("swap_out_blocks", "swap_in_blocks"):
        real = getattr(host, name)
        monkeypatch.setattr(host, name, lambda cache, mapping, real=real, name=name: (
            calls.append((name, list(mapping))), real(cache, mapping))[1])
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda *a, **k: (calls.append(("forward", None)), forward(*a, **k))[1])
    for i in range(4):
        engine.add_request(str(i), [(7 * i + j) % 500 for j in range(20)],
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_swap_outs > 0 and engine.scheduler.num_swap_fallbacks == 0
    names = [name for name, _ in calls]
    # every step: its swap-outs, then its swap-ins, then the forward pass
    assert names == ["swap_out_blocks", "swap_in_blocks", "forward"] * engine.num_steps
    assert any(mapping for name, mapping in calls if name == "swap_in_blocks")
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks


# --- the copies on a GPU: pinned staging buffers, events (run here with stand-ins) -------------


class LoggingEvent:
    """A stand-in for torch.cuda.Event that logs its calls, to check when buffers are reused."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self):
        self.log.append(("record", self.name))

    def synchronize(self):
        self.log.append(("synchronize", self.name))


def calls_of(log, name):
    return [call for call, event in log if event == name]


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_staged_copies_move_the_bytes_the_plain_copies_move(num_layers):
    from minipaged.swap import staged_swap_in, staged_swap_out

    gen = torch.Generator().manual_seed(num_layers)
    cache = KVCache(num_layers=num_layers, num_blocks=12, block_size=4, num_kv_heads=2,
                    head_dim=4)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=gen))
    device_ids = torch.randperm(12, generator=gen)[:5]
    host_ids = torch.randperm(7, generator=gen)[:5]
    plain, staged = HostKVCache(7, 4), HostKVCache(7, 4)
    plain.swap_out_blocks(cache, zip(device_ids.tolist(), host_ids.tolist()))
    staged.allocate_like(cache)
    staging = [torch.empty((6, *cache.layers[0].shape[1:]), pin_memory=False) for _ in range(2)]
    log = []
    events = [LoggingEvent(0, log), LoggingEvent(1, log)]
    staged_swap_out(cache.layers, staged.layers, device_ids, host_ids, staging, events)
    # the pool is not filled when taken: only the blocks written hold known bytes
    assert all(torch.equal(a[host_ids], b[host_ids]) for a, b in zip(plain.layers, staged.layers))
    for name in (0, 1):  # each copy lands before the CPU reads its buffer or it is reused
        calls = calls_of(log, name)
        assert calls == ["record", "synchronize"] * (len(calls) // 2)
    assert len(log) == 2 * num_layers

    back = [torch.full_like(layer, float("nan")) for layer in cache.layers]
    into = torch.randperm(12, generator=gen)[:5]
    log.clear()
    staged_swap_in(staged.layers, back, host_ids, into, staging, events)
    for name in (0, 1):  # the CPU waits for a buffer's last copy before it rewrites the buffer
        calls = calls_of(log, name)
        assert calls == ["synchronize", "record"] * (len(calls) // 2)
    for restored, original in zip(back, cache.layers):
        assert torch.equal(restored[into], original[device_ids])
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[into] = False
        assert restored[untouched].isnan().all()


def test_pinned_bytes_are_the_allocators_power_of_two():
    """torch's caching host allocator pins the next power of two of a request's bytes."""
    from minipaged.memory import QWEN2_5_0_5B, GiB, MiB
    from minipaged.swap import pinned_bytes

    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 4, 5, 1000)] == [0, 1, 2, 4, 4, 8, 1024]
    assert pinned_bytes(2**20) == 2**20 and pinned_bytes(2**20 + 1) == 2**21
    # the figure: vLLM's default 4 GiB over Qwen2.5-0.5B's 24 layers, one tensor each
    block = 16 * QWEN2_5_0_5B.kv_bytes_per_token
    layer = 4 * GiB // block * block // QWEN2_5_0_5B.num_layers
    assert 170 * MiB < layer < 171 * MiB and pinned_bytes(layer) == 256 * MiB
    assert QWEN2_5_0_5B.num_layers * pinned_bytes(layer) == 6 * GiB


def test_on_a_gpu_only_the_staging_buffers_are_pinned_at_the_allocators_size(monkeypatch):
    import minipaged.swap

    pins, empty, emptied = [], torch.empty, []

    def allocate_unpinned(*args, pin_memory=False, **kwargs):
        pins.append(pin_memory)
        return empty(*args, **kwargs)  # this machine has nothing to pin with

    cache = random_cache(8, 4)  # 256 bytes a block in each layer
    originals = [layer[[1, 4, 6]].clone() for layer in cache.layers]
    monkeypatch.setattr(minipaged.swap, "pinned_host", lambda device: True)  # "a GPU"
    monkeypatch.setattr(minipaged.swap, "empty_host_cache", lambda: emptied.append(len(pins)))
    monkeypatch.setattr(torch, "empty", allocate_unpinned)
    host = HostKVCache(num_blocks=8, block_size=4)
    host.swap_out_blocks(cache, [(1, 0), (4, 1), (6, 2)])
    for layer in cache.layers:
        layer[[1, 4, 6]] = float("nan")
    host.swap_in_blocks(cache, [(0, 7), (1, 0), (2, 3)])
    assert pins == [False] * 2 + [True] * 2  # the pool's layers pageable, the staging pinned
    assert emptied == [2]  # torch's cache emptied as the first pair was made
    # 3 blocks of 256 bytes would pin 1,024 bytes anyway: each buffer takes 4 blocks
    assert len(host.staging) == 2 and host.staging[0].shape[0] == 4
    assert host.num_pinned_bytes() == 2 * 1024
    host.swap_out_blocks(cache, [(b, b) for b in range(3, 8)])  # 5 blocks: the pair grows
    assert pins[4:] == [True] * 2 and emptied == [2, 4] and host.staging[0].shape[0] == 8
    assert host.num_pinned_bytes() == 2 * 2048
    monkeypatch.undo()
    assert all(torch.equal(layer[[7, 0, 3]], o) for layer, o in zip(cache.layers, originals))
    assert host.num_bytes_swapped_out == 8 * host.bytes_per_block(cache)
    plain = HostKVCache(num_blocks=4, block_size=4)  # on a CPU: no staging, nothing pinned
    plain.swap_out_blocks(cache, [(0, 0)])
    assert plain.staging == [] and plain.num_pinned_bytes() == 0


# --- the host pool's size: a budget in bytes, bounded by the host's memory -------------------


def test_swap_space_sizes_the_host_pool_in_bytes_of_the_cache_blocks(monkeypatch):
    import minipaged.swap
    from minipaged.memory import GiB

    monkeypatch.setattr(minipaged.swap, "free_memory_bytes", lambda device: 64 * GiB)
    manager = KVCacheManager(BlockPool(7, 4))
    scheduler = SwapScheduler(manager, max_num_seqs=4, max_model_len=64)
    assert scheduler.block_bytes is None and scheduler.host.pool.num_blocks == 7  # unpriced
    scheduler.set_swap_space(10 * 1000 + 999, block_bytes=1000)
    assert scheduler.block_bytes == 1000
    assert scheduler.host.pool.num_blocks == 10  # whole blocks of the budget
    capped = SwapScheduler(manager, max_num_seqs=4, max_model_len=64)
    capped.set_swap_space(GiB, block_bytes=1000)
    assert capped.host.pool.num_blocks == 4 * 16  # no more than the queues can fill
    with pytest.raises(ValueError, match="block_bytes"):
        capped.set_swap_space(GiB, block_bytes=0)
    llm = LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap",
              swap_space=0.001)
    engine = llm.llm_engine
    block_bytes = HostKVCache.bytes_per_block(engine.kv_cache)
    assert engine.scheduler.block_bytes == block_bytes
    assert engine.scheduler.host.pool.num_blocks == int(0.001 * GiB) // block_bytes
    default = LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap")
    assert default.llm_engine.scheduler.host.pool.num_blocks == min(4 * GiB // block_bytes,
                                                                      256 * 4)
    with pytest.raises(ValueError, match="swap_space"):
        LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap", swap_space=0)
    for bad in (-1, "4", float("nan")):
        with pytest.raises(ValueError, match="swap_space"):
            LLM(max_model_len=64, num_gpu_blocks_override=8, swap_space=bad)


def test_a_host_pool_larger_than_the_host_is_refused_before_anything_is_taken(monkeypatch):
    import minipaged.swap

    monkeypatch.setattr(minipaged.swap, "free_memory_bytes", lambda device: 10_000)
    manager = KVCacheManager(BlockPool(7, 4))
    scheduler = SwapScheduler(manager)
    scheduler.set_swap_space(10_000, block_bytes=1000)
    assert scheduler.host.pool.num_blocks == 10
    host = scheduler.host
    with pytest.raises(ValueError, match="num_cpu_blocks=11 .* 10,000 bytes"):
        scheduler.set_num_cpu_blocks(11)
    scheduler.set_swap_space(10_999, block_bytes=1000)  # buys 10 blocks: 10,000 bytes fit
    assert scheduler.host.pool.num_blocks == 10
    host = scheduler.host
    with pytest.raises(ValueError, match="swap_space=.* GiB asks for 11,000 bytes"):
        scheduler.set_swap_space(11_000, block_bytes=1000)
    assert scheduler.host is host
    for too_many in (11, 10**6, 10**12):  # 10**12 once hung making the pool's block ids
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            scheduler.set_num_cpu_blocks(too_many)
        assert scheduler.host is host
    with pytest.raises(ValueError, match="swap_space"):
        LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap", swap_space=1)
    # without block_bytes the scheduler cannot price its pool: the bytes are checked when taken
    cache = random_cache(8, 4)  # 512 bytes a block
    unpriced = SwapScheduler(KVCacheManager(BlockPool(8, 4)), num_cpu_blocks=40)
    with pytest.raises(ValueError, match="num_cpu_blocks=40"):
        unpriced.host.swap_out_blocks(cache, [(0, 0)])
    assert unpriced.host.layers == [] and unpriced.host.num_bytes_swapped_out == 0


def test_the_budget_is_capped_before_it_is_checked(monkeypatch):
    """A budget larger than the host is accepted when the queues cap the pool below it: only
    what the pool will take is checked (chapter 11's small runs under a 4 GiB default)."""
    import minipaged.swap
    from minipaged.memory import GiB

    available = [64 * 1000]
    monkeypatch.setattr(minipaged.swap, "free_memory_bytes", lambda device: available[0])
    scheduler = SwapScheduler(KVCacheManager(BlockPool(7, 4)), max_num_seqs=4, max_model_len=64)
    scheduler.set_swap_space(4 * GiB, block_bytes=1000)  # 4 GiB asked, 64 blocks fillable
    assert scheduler.host.pool.num_blocks == 4 * 16
    available[0] = 64 * 1000 - 1
    with pytest.raises(ValueError, match="swap_space=4 GiB asks for 64,000 bytes"):
        scheduler.set_swap_space(4 * GiB, block_bytes=1000)


def test_the_real_host_refuses_a_pool_of_a_trillion_blocks():
    llm = LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap",
              swap_space=0.001)
    with pytest.raises(ValueError, match="num_cpu_blocks=1000000000000 .* available"):
        llm.llm_engine.scheduler.set_num_cpu_blocks(10**12)
