"""The whole engine under random use: a stateful machine over one LLM per run (adds with n up
to 4, ids given again once done, refused prompts, steps, aborts of child, parent and unknown
ids, streams closed early, generate calls amid the rest), and randomized pressure at 2.5x to 10x
oversubscription of the pool, compared token for token with the same workload on an ample pool
of the plainest engine. After every rule: no count below zero, every live request in exactly one
queue, no block held by a finished request; after everything: every block free."""
from __future__ import annotations

import functools
import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from minipaged import LLM, SamplingParams
from minipaged.model import ModelConfig, random_model
from minipaged.scheduler import ParentRequest, RequestStatus

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BLOCK = 16
MAX_LEN = 128
VOCAB = 64  # small, so that sampled tokens hit the end-of-sequence token now and then
EOS = 7


@functools.cache
def machine_model():
    """A float32 random model; its small vocabulary makes EOS and stop tokens come up."""
    config = ModelConfig.small(num_layers=2, vocab_size=VOCAB, max_position_embeddings=MAX_LEN,
                               eos_token_id=EOS)
    return random_model(config, seed=0)


@functools.cache
def pressure_model():
    """The float32 model of the pressure tests: no EOS, so every answer runs to max_tokens
    unless a stop token ends it."""
    return random_model(ModelConfig.small(num_layers=2, max_position_embeddings=MAX_LEN), seed=0)


# --- what every state of the engine must satisfy ----------------------------------------------


def live_children(engine):
    """The requests a forking engine holds back (aborted ones stay listed until released)."""
    return [c for children in getattr(engine, "held", {}).values() for c in children
            if not c.status.finished]


def check_engine(engine):
    """The invariants of any moment between two steps."""
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    pool = engine.pool
    # counts: none below zero, and each block's count is the tables that hold it
    assert all(block.ref_cnt >= 0 for block in pool.blocks)
    assert not getattr(manager, "blocks_to_copy", []), "copies left over after a step"
    holders = Counter(block.block_id for table in manager.block_tables.values()
                      for block in table.blocks)
    assert [b.ref_cnt for b in pool.blocks] == [holders[i] for i in range(pool.num_blocks)]
    free = [b.block_id for b in pool.free_block_queue]
    assert len(free) == len(set(free)) == pool.get_num_free_blocks()
    assert set(free) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    cached = getattr(pool, "cached_block_hash_to_block", None)
    if cached is not None:
        for digest, block in cached.items():
            assert block.block_hash == digest
        assert sum(b.block_hash is not None for b in pool.blocks) == len(cached)

    # every live request is in exactly one place: waiting, running, swapped out or held back
    swapped = list(getattr(scheduler, "swapped", []))
    held = live_children(engine)
    placed = ([r.request_id for r in scheduler.waiting] + [r.request_id for r in scheduler.running]
              + [r.request_id for r in swapped] + [r.request_id for r in held])
    assert len(placed) == len(set(placed)), f"a request is queued twice: {sorted(placed)}"
    assert sorted(placed) == sorted(engine.requests)
    assert len(engine.requests) == (len(scheduler.waiting) + len(scheduler.running)
                                    + len(swapped) + len(held))
    for request_id, request in engine.requests.items():
        assert request.request_id == request_id and not request.status.finished
        if request.parent is not None:
            assert engine.parent_requests.get(request.parent.request_id) is request.parent
    for parent_id, parent in engine.parent_requests.items():
        assert parent.request_id == parent_id
        assert any(not c.status.finished for c in parent.child_requests)
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
    for request in list(scheduler.waiting) + held:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    for first_id in getattr(engine, "held", {}):
        assert first_id in engine.requests  # a child 0 that is gone releases its children

    # blocks: only running requests hold device blocks, only swapped ones host blocks
    running = {r.request_id for r in scheduler.running}
    assert set(manager.block_tables) <= running, (
        f"blocks held by requests not running: {set(manager.block_tables) - running}")
    host = getattr(scheduler, "host", None)
    if host is not None:
        assert set(scheduler.host_tables) == {r.request_id for r in swapped}
        host_holders = Counter(b.block_id for t in scheduler.host_tables.values()
                               for b in t.blocks)
        assert [b.ref_cnt for b in host.pool.blocks] == [
            host_holders[i] for i in range(host.pool.num_blocks)]
        assert host.pool.get_num_free_blocks() == host.pool.num_blocks - sum(host_holders.values())


def check_all_free(engine):
    """The invariant once everything is finished or aborted."""
    check_engine(engine)
    pool, scheduler = engine.pool, engine.scheduler
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert not engine.requests and not engine.parent_requests
    assert not getattr(engine, "held", {})
    assert not scheduler.waiting and not scheduler.running
    assert not getattr(scheduler, "swapped", [])
    assert not engine.has_unfinished_requests()
    manager = scheduler.kv_cache_manager
    assert not manager.block_tables
    assert not getattr(manager, "num_cached_block", {})
    host = getattr(scheduler, "host", None)
    if host is not None:
        assert not scheduler.host_tables
        assert host.pool.get_num_free_blocks() == host.pool.num_blocks
        assert all(block.ref_cnt == 0 for block in host.pool.blocks)


def check_finished(request, max_model_len=MAX_LEN):
    """A request that ended by itself ended for the reason its last token gives."""
    params, status = request.sampling_params, request.status
    assert request.num_output_tokens <= (params.max_tokens or MAX_LEN)
    if status is RequestStatus.FINISHED_ABORTED:
        return
    assert request.num_output_tokens >= 1
    last = request.all_token_ids[-1]
    stops = ([] if params.ignore_eos else [request.eos_token_id]) + list(params.stop_token_ids)
    if status is RequestStatus.FINISHED_STOPPED:
        assert last in stops
    else:
        assert status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert request.num_output_tokens == params.max_tokens or (
            request.num_tokens >= max_model_len)
    # nothing stopped it earlier
    for token in request.output_token_ids[:-1]:
        assert token not in stops


def run_to_end(llm, limit=3000):
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            return
        llm._step_and_route()  # what generate and stream call: open streams get their tokens
    raise AssertionError(f"the engine is stuck: requests left after {limit} steps")


# --- the stateful machine -----------------------------------------------------------------------

PREFIXES = [(), tuple(range(10, 26)), tuple(range(10, 34)), (40,) * 8, tuple(range(10, 58))]


def prompts():
    return st.builds(lambda prefix, tail: list(prefix) + tail, st.sampled_from(PREFIXES),
                     st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24))


MAX_TOKENS = st.integers(1, 12) | st.integers(13, 48)  # long ones cross blocks: preemptions


def sampling_params(max_tokens=MAX_TOKENS):
    kinds = st.sampled_from(["greedy", "seeded", "unseeded", "nucleus"])
    return st.builds(make_params, st.integers(1, 4), kinds, max_tokens, st.booleans(),
                     st.sampled_from([(), (), (3,), (EOS, 11)]), st.integers(0, 1000))


def make_params(n, kind, max_tokens, ignore_eos, stop, seed):
    common = dict(n=n, max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=list(stop))
    if kind == "greedy":
        return SamplingParams(temperature=0, **common)
    if kind == "seeded":
        return SamplingParams(seed=seed, **common)
    if kind == "nucleus":
        return SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=seed, **common)
    return SamplingParams(**common)  # seeded from the engine's seed and the request id


SALTS = st.sampled_from([None, None, "a", "b"])


class EngineMachine(RuleBasedStateMachine):
    """Adds, steps, aborts and streams against one engine, options drawn once per run."""

    @initialize(caching=st.booleans(), sampling=st.sampled_from(["split", "fork"]),
                preemption=st.sampled_from(["recompute", "swap"]),
                swap_space=st.sampled_from([4, 2e-4, 4e-5]),  # 4 GiB, 6 blocks, 1 block
                unit=st.sampled_from([None, None, 4, 8]),
                num_blocks=st.sampled_from([8, 8, 9, 10, 12, 16, 24, 64]),
                max_num_seqs=st.sampled_from([3, 256, 256]),
                max_num_batched_tokens=st.sampled_from([16, 48, 2048]),
                finish=st.sampled_from(["run", "abort"]))
    def start(self, caching, sampling, preemption, swap_space, unit, num_blocks, max_num_seqs,
              max_num_batched_tokens, finish):
        self.llm = LLM(machine_model(), num_gpu_blocks_override=num_blocks,
                       max_model_len=MAX_LEN, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens,
                       enable_prefix_caching=caching, parallel_sampling=sampling,
                       preemption_mode=preemption, swap_space=swap_space,
                       prefix_match_unit=unit if caching else None, seed=0)
        self.engine = self.llm.llm_engine
        self.finish = finish
        self.seen = {}  # the latest request queued under each id, streams' too
        self.every = []  # every request ever queued (an id may be reused once it is done)
        self.ended = {}  # request -> its tokens when it was first seen finished
        self.parents = []  # every ParentRequest, for the prompts asked with n > 1
        self.streams = []  # open streams: [generator, {(id, index): tokens}, {done ids}]
        self.next_id = 0
        queue = self.engine.queue_request

        def spy(request):  # a test's view of every request the engine queues
            old = self.seen.get(request.request_id)
            assert old is None or old.status.finished, "a live id was queued again"
            self.seen[request.request_id] = request
            self.every.append(request)
            return queue(request)

        self.engine.queue_request = spy

    def live_count(self):
        return len(self.engine.requests) + sum(len(h) for h in getattr(self.engine, "held",
                                                                         {}).values())

    # adding -------------------------------------------------------------------------------

    @rule(prompt=prompts(), params=sampling_params(), salt=SALTS, reuse=st.booleans())
    def add(self, prompt, params, salt, reuse):
        if self.live_count() >= 12:
            return
        tops = {r.request_id if r.parent is None else r.parent.request_id for r in self.every}
        done = sorted(i for i in tops if i.startswith("m") and i not in self.engine.requests
                      and i not in self.engine.parent_requests
                      and not any(f"{k}_{i}" in self.engine.requests for k in range(4)))
        if reuse and done:  # an id whose requests are all done may be given again
            request_id = done[len(self.every) % len(done)]
        else:
            request_id = f"m{self.next_id}"
            self.next_id += 1
        entry = self.engine.add_request(request_id, prompt, params, cache_salt=salt)
        if params.n > 1:
            assert isinstance(entry, ParentRequest) and len(entry.child_requests) == params.n
            assert self.engine.parent_requests[request_id] is entry
            self.parents.append(entry)
        else:
            assert self.engine.requests[request_id] is entry

    @rule(bad=st.sampled_from([[], [VOCAB], [-1], [1] * (MAX_LEN + 1), "12"]))
    def add_a_bad_prompt(self, bad):
        before = (sorted(self.engine.requests), len(self.engine.scheduler.waiting))
        with pytest.raises(ValueError):
            self.engine.add_request(f"bad{self.next_id}", bad, SamplingParams(n=2))
        assert (sorted(self.engine.requests), len(self.engine.scheduler.waiting)) == before

    @rule(batch=st.lists(st.tuples(prompts(), sampling_params(st.integers(1, 8)), SALTS),
                         min_size=1, max_size=2))
    def generate(self, batch):
        """generate runs its own prompts to the end, stepping everyone else's too (first come,
        first served: most of what is queued, so only when little is)."""
        if self.live_count() >= 4:
            return
        items = [{"prompt_token_ids": p} | ({} if s is None else {"cache_salt": s})
                 for p, _, s in batch]
        outputs = self.llm.generate(items, [params for _, params, _ in batch], use_tqdm=False)
        assert len(outputs) == len(batch)
        for output, (prompt, params, _) in zip(outputs, batch):
            assert output.finished and output.prompt_token_ids == prompt
            assert [c.index for c in output.outputs] == list(range(params.n))
            for completion in output.outputs:
                assert completion.finish_reason in ("stop", "length")
                assert 1 <= len(completion.token_ids) <= params.max_tokens

    @rule()
    def add_a_taken_id(self):
        live = sorted(self.engine.requests) + sorted(self.engine.parent_requests)
        if not live:
            return
        before = sorted(self.engine.requests)
        with pytest.raises(ValueError, match="already in the engine"):
            self.engine.add_request(live[0], [1, 2, 3], SamplingParams(n=2))
        assert sorted(self.engine.requests) == before  # a refused prompt changes nothing

    # stepping -----------------------------------------------------------------------------

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(times=st.integers(1, 8))
    def step(self, times):
        for _ in range(times):
            if not self.engine.has_unfinished_requests():
                return
            before = {i: r.num_output_tokens for i, r in self.engine.requests.items()}
            sampled = self.llm._step_and_route()
            for request in sampled:  # each sampled request got exactly one token
                if request.request_id in before:
                    assert request.num_output_tokens == before[request.request_id] + 1
            assert len({r.request_id for r in sampled}) == len(sampled)

    # aborting -----------------------------------------------------------------------------

    @rule(data=st.data())
    def abort(self, data):
        ids = sorted(self.engine.requests) + sorted(self.engine.parent_requests)
        ids += sorted(self.seen)[:3] + ["nobody", "0_nobody"]  # finished and unknown ids too
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3))
        single = data.draw(st.booleans())
        gone = []
        for request_id in chosen:
            parent = self.engine.parent_requests.get(request_id)
            gone += parent.child_requests if parent else (
                [self.engine.requests[request_id]] if request_id in self.engine.requests else [])
        self.engine.abort_request(chosen[0] if single else chosen)
        if single:
            self.engine.abort_request(chosen)  # a second abort of the same ids: a no-op
        for request in gone:
            assert request.status.finished
            assert request.request_id not in self.engine.requests

    # streaming ----------------------------------------------------------------------------

    @rule(prompt=prompts(), params=sampling_params(), salt=SALTS, k=st.integers(0, 6),
          keep_open=st.booleans())
    def open_stream(self, prompt, params, salt, k, keep_open):
        if self.live_count() >= 12:
            return
        item = {"prompt_token_ids": prompt}
        if salt is not None:
            item["cache_salt"] = salt
        stream = [self.llm.stream(item, params), {}, set()]
        self.streams.append(stream)
        for _ in range(k):
            if not self.pull(stream):
                break
        if not keep_open:
            self.close(stream)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), times=st.integers(1, 4))
    def pull_stream(self, data, times):
        stream = data.draw(st.sampled_from(self.streams))
        for _ in range(times):
            if not self.pull(stream):
                return

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def close_stream(self, data):
        self.close(data.draw(st.sampled_from(self.streams)))

    def pull(self, stream):
        """One output of a stream; False once it is exhausted (and then removed)."""
        generator, got, done = stream
        try:
            output = next(generator)
        except StopIteration:
            self.streams.remove(stream)
            self.check_streamed(got, done)
            return False
        assert len(output.outputs) == 1
        completion = output.outputs[0]
        key = (output.request_id, completion.index)
        assert key not in done, f"an output for {key} after its finished one"
        got.setdefault(key, []).extend(completion.token_ids)
        if output.finished:
            done.add(key)
            assert completion.finish_reason in ("stop", "length", "abort")
        else:
            assert len(completion.token_ids) == 1
        return True

    def check_streamed(self, got, done):
        """An exhausted stream said every completion ended, and carried every token of each."""
        assert set(got) == done
        for (request_id, index), tokens in got.items():
            child_id = request_id if request_id in self.seen else f"{index}_{request_id}"
            request = self.seen[child_id]
            assert request.status.finished
            assert tokens == request.output_token_ids

    def close(self, stream):
        generator, got, done = stream
        generator.close()  # withdraws what the stream has left
        if stream in self.streams:
            self.streams.remove(stream)
        for (request_id, index) in got:
            child_id = request_id if request_id in self.seen else f"{index}_{request_id}"
            assert self.seen[child_id].status.finished

    # invariants ---------------------------------------------------------------------------

    @invariant()
    def engine_is_consistent(self):
        if not hasattr(self, "engine"):
            return
        check_engine(self.engine)

    @invariant()
    def finished_requests_hold_nothing_and_stay_put(self):
        if not hasattr(self, "engine"):
            return
        manager = self.engine.scheduler.kv_cache_manager
        host_tables = getattr(self.engine.scheduler, "host_tables", {})
        for request in self.every:
            request_id = request.request_id
            if not request.status.finished:
                assert self.engine.requests.get(request_id) is request
                continue
            assert self.engine.requests.get(request_id) is not request
            if request_id not in self.engine.requests:  # (not given again to a live one)
                assert request_id not in manager.block_tables
                assert request_id not in host_tables
                assert request_id not in getattr(manager, "pending", {})
                assert request_id not in getattr(manager, "num_cached_block", {})
                assert request_id not in self.llm._inboxes or self.streams
            if request not in self.ended:
                check_finished(request)
                self.ended[request] = list(request.all_token_ids)
            assert request.all_token_ids == self.ended[request]  # nothing after the end
        for parent in self.parents:
            if all(c.status.finished for c in parent.child_requests):
                assert self.engine.parent_requests.get(parent.request_id) is not parent

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        for stream in list(self.streams):
            if self.finish == "run":  # listen to the end: every token arrives
                while self.pull(stream):
                    pass
            else:
                self.close(stream)
        if self.finish == "run":
            run_to_end(self.llm)
        else:
            self.engine.abort_request(sorted(self.engine.parent_requests))
            self.engine.abort_request(sorted(self.engine.requests))
        self.finished_requests_hold_nothing_and_stay_put()
        check_all_free(self.engine)
        if self.finish == "run":
            assert self.engine.step() == []  # nothing left: a step does nothing


EngineMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=30, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.pytestmark = [pytest.mark.heavy]  # a stateful search over the engine: seconds


class WideEngineMachine(EngineMachine):
    """The same machine, searched longer: minutes."""


WideEngineMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestWideEngineMachine = WideEngineMachine.TestCase
TestWideEngineMachine.pytestmark = [pytest.mark.slow, pytest.mark.heavy]


# --- randomized pressure, compared with an ample pool -------------------------------------------

# (enable_prefix_caching, parallel_sampling, preemption_mode, prefix_match_unit)
CONFIGS = [(cache, mode, preempt, unit)
           for cache in (False, True) for unit in ((None,) if not cache else (None, 4))
           for mode in ("split", "fork") for preempt in ("recompute", "swap")]


def make_workload(seed):
    """Waves of requests over shared prefixes with salts, n up to 4, greedy and sampled, and
    a pool sized to 2.5x to 10x oversubscription of what they need at full length."""
    rng = random.Random(seed)
    ratio = rng.uniform(2.5, 9)
    num_blocks = rng.randint(8, 16)
    target = ratio * num_blocks
    stems = [[rng.randrange(512) for _ in range(rng.choice([16, 24, 32]))] for _ in range(3)]
    waves, need = [[] for _ in range(rng.randint(1, 3))], 0
    index = 0
    while need < target:
        stem = rng.choice(stems + [[]])
        prompt = stem[:rng.randint(0, len(stem))] + [rng.randrange(512)
                                                    for _ in range(rng.randint(1, 20))]
        n = rng.choice([1, 1, 2, 3, 4])
        max_tokens = rng.choice([rng.randint(1, 8), rng.randint(16, 48)])  # long ones grow
        kind = rng.choice(["greedy", "seeded", "unseeded", "nucleus"])
        params = make_params(n, kind, max_tokens, True, rng.choice([(), (), (5,)]),
                             rng.randrange(1000))
        salt = rng.choice([None, None, "s1", "s2"])
        need += n * math.ceil((len(prompt) + max_tokens) / BLOCK)
        rng.choice(waves).append((f"w{index}", prompt, params, salt))
        index += 1
    gaps = [rng.randint(0, 6) for _ in waves]
    return waves, gaps, num_blocks, need / num_blocks


def run_workload(llm, waves, gaps):
    """Queue each wave after the steps of its gap; run to the end; every request's tokens."""
    engine = llm.llm_engine
    entries = []
    for wave, gap in zip(waves, gaps):
        for _ in range(gap):
            if engine.has_unfinished_requests():
                engine.step()
        for request_id, prompt, params, salt in wave:
            entries.append(engine.add_request(request_id, prompt, params, cache_salt=salt))
    run_to_end(llm)
    answers = {}
    for entry in entries:
        children = entry.child_requests if isinstance(entry, ParentRequest) else [entry]
        for child in children:
            check_finished(child)
            assert child.status is not RequestStatus.FINISHED_ABORTED
            answers[child.request_id] = list(child.output_token_ids)
    check_all_free(engine)
    return answers


def pressure_llm(config, num_blocks, options):
    cache, mode, preempt, unit = config
    return LLM(pressure_model(), num_gpu_blocks_override=num_blocks, max_model_len=MAX_LEN,
               enable_prefix_caching=cache, parallel_sampling=mode, preemption_mode=preempt,
               prefix_match_unit=unit, seed=0, **options)


def check_pressure(seed):
    waves, gaps, num_blocks, ratio = make_workload(seed)
    assert 2.5 <= ratio <= 10.5, ratio
    rng = random.Random(seed + 1000)
    config = CONFIGS[seed % len(CONFIGS)]
    options = dict(max_num_seqs=rng.choice([4, 16, 256]),
                   max_num_batched_tokens=rng.choice([32, 2048]))
    if config[2] == "swap":
        options["swap_space"] = rng.choice([4, 2e-4, 4e-5])  # ample, 6 blocks, 1 block
    ample = run_workload(pressure_llm((False, "split", "recompute", None), 512, {}),
                         waves, gaps)
    tight_llm = pressure_llm(config, num_blocks, options)
    tight = run_workload(tight_llm, waves, gaps)
    assert tight == ample, f"config {config}, {options}, {num_blocks} blocks, ratio {ratio:.1f}"
    return tight_llm.llm_engine.stats()


# 10: caching, sub-block hits, forks and preemption by recompute; 23: the same with swaps, some
# falling back to recompute when the small host pool is full
@pytest.mark.heavy  # seconds each: make test runs them, make check does not
@pytest.mark.parametrize("seed", [10, 23])
def test_pressure_matches_an_ample_pool(seed):
    stats = check_pressure(seed)
    assert stats["num_preemptions"] > 0 and stats["sub_block_hits"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(36))
def test_pressure_matches_an_ample_pool_wide(seed):
    check_pressure(seed)
