"""Chapter 2: the workload, the three allocators and the simulator, against brute force."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.fragmentation import (
    STUDY_POOL_TOKENS,
    Allocator,
    BlockAllocator,
    ExactFit,
    FreeExtents,
    MaxLengthReservation,
    MaxTree,
    Workload,
    arrival_rate_for_load,
    bad_input_catalogue,
    erlang_b,
    live_total,
    make_workload,
    pool_over_time,
    pool_shares,
    sample_total_lengths,
    simulate,
    three_allocators,
    workload_moments,
)

# ---------------------------------------------------------------- brute-force helpers


def free_runs(used: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of free positions as (start, length), by address."""
    runs, start = [], None
    for i, taken in enumerate(list(used) + [True]):
        if not taken and start is None:
            start = i
        elif taken and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def longest_free_run(used: np.ndarray) -> int:
    return max((length for _, length in free_runs(used)), default=0)


# A program of operations: admit a request of some length, or release the k-th live request.
operations = st.lists(
    st.one_of(st.tuples(st.just("admit"), st.integers(1, 12)),
              st.tuples(st.just("release"), st.integers(0, 1_000))),
    max_size=60,
)

# ---------------------------------------------------------------- lengths and traces


def test_lengths_are_seeded_clipped_integers():
    a = sample_total_lengths(50_000, seed=3)
    assert a.dtype == np.int64
    assert a.min() >= 1 and a.max() <= 2048
    np.testing.assert_array_equal(a, sample_total_lengths(50_000, seed=3))
    assert not np.array_equal(a, sample_total_lengths(50_000, seed=4))


def test_lengths_have_the_requested_median_and_mean():
    lengths = sample_total_lengths(400_000, seed=0)
    assert abs(np.median(lengths) - 180) <= 2
    assert abs(lengths.mean() - 260) < 5  # the cap trims the mean slightly
    short = sample_total_lengths(10_000, seed=0, median=10.0, mean=10.0, cap=64)
    assert np.all(short == 10)  # mean equal to median: no spread at all
    assert sample_total_lengths(1_000, cap=100).max() == 100


@pytest.mark.parametrize("kwargs, field", [
    ({"num": -1}, "num"),
    ({"num": 10, "median": 300.0, "mean": 260.0}, "median"),
    ({"num": 10, "median": 0.0}, "median"),
    ({"num": 10, "cap": 0}, "cap"),
    ({"num": 3, "mean": float("nan")}, "mean"),  # used to return INT64_MIN
    ({"num": 3, "mean": float("inf")}, "mean"),
    ({"num": 3, "median": float("nan")}, "median"),
    ({"num": 3, "cap": float("nan")}, "cap"),
    ({"num": 2.5}, "num"),
])
def test_lengths_reject_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        sample_total_lengths(**kwargs)


def test_workload_is_reproducible_and_consistent():
    a = make_workload(5_000, 50.0, seed=7)
    b = make_workload(5_000, 50.0, seed=7)
    for field in ("arrival_times", "prompt_lens", "answer_lens"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(a.total_lens, sample_total_lengths(5_000, seed=7))
    assert np.all(a.answer_lens >= 1) and np.all(a.prompt_lens >= 0)
    assert np.all(np.diff(a.arrival_times) >= 0)
    np.testing.assert_allclose(a.lifetimes, a.answer_lens / 30.0)
    assert abs(a.num_requests / a.arrival_times[-1] - 50.0) < 3.0
    share = a.prompt_lens / a.total_lens
    assert share.min() > 0.15 and share.max() < 0.85


@pytest.mark.parametrize("kwargs, field", [
    ({"num_requests": 0, "arrival_rate": 1.0}, "num_requests"),
    ({"num_requests": 10, "arrival_rate": 0.0}, "arrival_rate"),
    ({"num_requests": 10, "arrival_rate": -2.0}, "arrival_rate"),
    ({"num_requests": 10, "arrival_rate": 1.0, "decode_rate": 0.0}, "decode_rate"),
    ({"num_requests": 10, "arrival_rate": 1.0, "prompt_share": (0.5, 1.0)}, "prompt_share"),
    ({"num_requests": 10, "arrival_rate": 1.0, "median": 400.0}, "median"),
])
def test_workload_rejects_bad_input(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_workload(**kwargs)


def test_workload_from_lists_adds_elementwise():
    trace = Workload([0.0, 1.0], [5, 5], [5, 15], decode_rate=1)
    np.testing.assert_array_equal(trace.total_lens, [10, 20])  # not the list [5, 5, 5, 15]
    np.testing.assert_array_equal(trace.lifetimes, [5.0, 15.0])
    assert isinstance(trace.arrival_times, np.ndarray) and trace.decode_rate == 1.0


@pytest.mark.parametrize("fields, field", [
    (([0.0, 1.0], [5], [5, 15], 1.0), "prompt_lens"),
    (([0.0, 1.0], [5, 5], [5], 1.0), "answer_lens"),
    (([0.0, 1.0], [5.0, 5.0], [5, 15], 1.0), "prompt_lens"),  # lengths are whole tokens
    (([0.0, 1.0], [5, 5], [5, 0], 1.0), "answer_lens"),
    (([0.0, 1.0], [-1, 5], [5, 5], 1.0), "prompt_lens"),
    (([1.0, 0.0], [5, 5], [5, 5], 1.0), "arrival_times"),
    (([0.0, float("nan")], [5, 5], [5, 5], 1.0), "arrival_times"),
    (([], [], [], 1.0), "arrival_times"),
    (([0.0], [5], [5], float("nan")), "decode_rate"),
    (([0.0], [5], [5], 0.0), "decode_rate"),
])
def test_workload_fields_are_checked(fields, field):
    with pytest.raises(ValueError, match=field):
        Workload(*fields)


def test_offered_load_matches_its_definition():
    rate = arrival_rate_for_load(0.7, 100_000)
    trace = make_workload(200_000, rate, seed=1)
    token_seconds = np.sum(trace.total_lens * trace.lifetimes)
    assert token_seconds / trace.arrival_times[-1] / 100_000 == pytest.approx(0.7, rel=0.03)
    assert arrival_rate_for_load(1.4, 100_000) == pytest.approx(2 * rate)
    mean_lifetime, _ = workload_moments()
    assert mean_lifetime == pytest.approx(trace.lifetimes.mean(), rel=0.02)


@pytest.mark.parametrize("load, pool, field", [(0.0, 10, "load"), (-1.0, 10, "load"),
                                               (float("nan"), 10, "load"),
                                               (float("inf"), 10, "load"),
                                               (1.0, 0, "pool_tokens"), (1.0, -5, "pool_tokens"),
                                               (1.0, float("nan"), "pool_tokens")])
def test_load_rejects_bad_input(load, pool, field):
    with pytest.raises(ValueError, match=field):
        arrival_rate_for_load(load, pool)


# ---------------------------------------------------------------- the search structures


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 40), writes=st.lists(st.tuples(st.integers(0, 39), st.integers(0, 50))),
       query=st.integers(0, 55))
def test_max_tree_finds_the_leftmost_position_at_least(size, writes, query):
    tree, values = MaxTree(size), [0] * size
    for position, value in writes:
        if position < size:
            tree.set(position, value)
            values[position] = value
    assert tree.max() == max(values)
    expected = next((i for i, v in enumerate(values) if v >= query), None)
    if query > 0:
        assert tree.leftmost_at_least(query) == expected


def test_coalescing_merges_both_neighbours():
    extents = FreeExtents(20)
    for start in (0, 5, 10, 15):
        extents.take(start, 5)
    assert extents.extents() == []
    extents.give(0, 5)
    extents.give(10, 5)
    assert extents.extents() == [(0, 5), (10, 5)]
    extents.give(5, 5)  # touches a free run on each side: all three become one
    assert extents.extents() == [(0, 15)]
    assert extents.tree.max() == 15
    extents.give(15, 5)
    assert extents.extents() == [(0, 20)]
    assert extents.first_fit(20) == 0 and extents.first_fit(21) is None


def test_best_fit_picks_the_shortest_run_that_fits():
    extents = FreeExtents(30)
    extents.take(0, 30)
    extents.give(0, 8)
    extents.give(12, 4)
    extents.give(20, 6)
    assert extents.first_fit(4) == 0
    assert extents.best_fit(4) == 12
    assert extents.best_fit(5) == 20
    assert extents.best_fit(9) is None


# ---------------------------------------------------------------- allocators against brute force


def run_program(allocator: Allocator, program, check):
    """Drive an allocator through admit/release operations, calling check after each admit."""
    live, next_id = [], 0
    for op, value in program:
        if op == "admit":
            admitted = allocator.admit(next_id, value)
            check(allocator, next_id, value, admitted)
            if admitted:
                live.append(next_id)
            next_id += 1
        elif live:
            allocator.release(live.pop(value % len(live)))
        assert 0 <= allocator.held_tokens <= allocator.pool_tokens
    for request_id in live:
        allocator.release(request_id)
    assert allocator.held_tokens == 0 and allocator.requested_tokens == 0 and not allocator.live


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@pytest.mark.parametrize("fit", ["first", "best"])
@settings(max_examples=80, deadline=None)
@given(pool=st.integers(1, 40), program=operations)
def test_exact_fit_refuses_only_when_no_run_is_long_enough(fit, pool, program):
    allocator = ExactFit(pool, fit=fit)
    used = np.zeros(pool, dtype=bool)

    def check(allocator, request_id, size, admitted):
        runs = [run for run in free_runs(used) if run[1] >= size]
        assert admitted == bool(runs)
        if admitted:
            start, held, _ = allocator.live[request_id]
            assert held == size
            if fit == "first":
                assert start == runs[0][0]
            else:
                assert start in [s for s, n in runs if n == min(n for _, n in runs)]
            assert not used[start:start + size].any()
            used[start:start + size] = True
        assert allocator.extents.extents() == free_runs(used)  # fully coalesced, always
        assert allocator.largest_free_run() == longest_free_run(used)

    original_release = allocator.release

    def release(request_id):
        start, held, _ = allocator.live[request_id]
        original_release(request_id)
        used[start:start + held] = False
        assert allocator.extents.extents() == free_runs(used)

    allocator.release = release
    run_program(allocator, program, check)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@settings(max_examples=80, deadline=None)
@given(extra=st.integers(0, 59), block_size=st.integers(1, 8), program=operations)
def test_blocks_refuse_only_when_too_few_blocks_are_free(extra, block_size, program):
    allocator = BlockAllocator(block_size + extra, block_size)  # at least one block

    def check(allocator, request_id, size, admitted):
        needed = -(-size // block_size)
        free_before = allocator.num_free_blocks + (needed if admitted else 0)
        assert admitted == (free_before >= needed)
        held_blocks = allocator.num_blocks - allocator.num_free_blocks
        assert allocator.held_tokens == held_blocks * block_size
        tail = allocator.held_tokens - allocator.requested_tokens  # unfinished last blocks
        assert 0 <= tail <= (block_size - 1) * len(allocator.live)

    run_program(allocator, program, check)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
@settings(max_examples=50, deadline=None)
@given(slots=st.integers(1, 6), extra=st.integers(0, 3), program=operations)
def test_reservation_is_a_fixed_number_of_slots(slots, extra, program):
    allocator = MaxLengthReservation(slots * 4 + extra, max_model_len=4)
    program = [(op, min(value, 4)) if op == "admit" else (op, value) for op, value in program]

    def check(allocator, request_id, size, admitted):
        live_before = len(allocator.live) - (1 if admitted else 0)
        assert admitted == (live_before < slots)
        assert allocator.held_tokens == 4 * len(allocator.live)

    run_program(allocator, program, check)


def test_reservation_rejects_requests_longer_than_the_limit():
    with pytest.raises(ValueError, match="max_model_len"):
        MaxLengthReservation(100, max_model_len=8).admit(0, 9)


@pytest.mark.parametrize("make, field", [
    (lambda: ExactFit(0), "pool_tokens"),
    (lambda: BlockAllocator(-16), "pool_tokens"),
    (lambda: MaxLengthReservation(0), "pool_tokens"),
    (lambda: BlockAllocator(1024, block_size=0), "block_size"),
    (lambda: BlockAllocator(1024, block_size=-4), "block_size"),
    (lambda: ExactFit(1024, fit="worst"), "fit"),
    (lambda: MaxLengthReservation(1024, max_model_len=0), "max_model_len"),
    (lambda: BlockAllocator(10, block_size=16), "pool_tokens"),  # not even one block
    (lambda: MaxLengthReservation(100, max_model_len=2048), "pool_tokens"),  # no slot
    (lambda: ExactFit(10.5), "pool_tokens"),
    (lambda: BlockAllocator(64, block_size=4.0), "block_size"),
])
def test_allocators_reject_bad_configuration(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("allocator", [ExactFit(64), BlockAllocator(64, 8),
                                       MaxLengthReservation(64, 16)], ids=lambda a: a.name)
def test_admit_and_release_are_checked(allocator):
    with pytest.raises(ValueError, match="num_tokens"):
        allocator.admit(0, 0)
    assert allocator.admit(1, 5)
    with pytest.raises(ValueError, match="request_id"):
        allocator.admit(1, 5)  # already live
    allocator.release(1)
    with pytest.raises(ValueError, match="request_id"):
        allocator.release(1)  # released twice
    with pytest.raises(ValueError, match="request_id"):
        allocator.release(99)  # never admitted
    assert allocator.held_tokens == 0


def pool_state(allocator):
    """Everything an admit may change, for before-and-after comparisons."""
    state = [allocator.held_tokens, allocator.requested_tokens, dict(allocator.live)]
    if isinstance(allocator, ExactFit):
        state += [allocator.extents.extents(), list(allocator.extents.tree.nodes)]
    else:
        state.append(allocator.num_free_blocks)
    return state


@pytest.mark.parametrize("make", [lambda: ExactFit(10), lambda: ExactFit(10, fit="best"),
                                  lambda: BlockAllocator(10, 2),
                                  lambda: MaxLengthReservation(10, 4)])
@pytest.mark.parametrize("bad", [2.5, 3.0, float("nan"), float("inf"), True, np.float64(2),
                                 "3", None, 0, -1])
def test_a_refused_length_leaves_the_pool_untouched(make, bad):
    allocator = make()
    assert allocator.admit(0, 2)
    before = pool_state(allocator)
    with pytest.raises(ValueError, match="num_tokens"):
        allocator.admit(1, bad)
    assert pool_state(allocator) == before
    assert allocator.admit(1, 4)  # ExactFit(10).admit(0, 2.5) used to leave this refused
    assert allocator.admit(2, np.int64(3)) == (not isinstance(allocator, MaxLengthReservation))
    for request_id in list(allocator.live):
        allocator.release(request_id)
    assert allocator.held_tokens == 0 and allocator.largest_free_run() >= 10 - 10 % 2


def test_demand_works_on_ints_and_arrays():
    lengths = np.array([1, 16, 17, 200])
    np.testing.assert_array_equal(BlockAllocator(1024, 16).demand(lengths), [16, 16, 32, 208])
    np.testing.assert_array_equal(MaxLengthReservation(4096).demand(lengths), [2048] * 4)
    np.testing.assert_array_equal(ExactFit(1024).demand(lengths), lengths)
    assert BlockAllocator(1024, 16).demand(17) == 32


# ---------------------------------------------------------------- the simulator


class Audited:
    """Wraps an allocator and checks conservation at every call."""

    def __init__(self, inner: Allocator):
        self.inner, self.admitted, self.released = inner, set(), []
        self.name, self.pool_tokens = inner.name, inner.pool_tokens

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def admit(self, request_id, num_tokens):
        ok = self.inner.admit(request_id, num_tokens)
        assert self.inner.held_tokens <= self.inner.pool_tokens
        if ok:
            self.admitted.add(request_id)
        return ok

    def release(self, request_id):
        self.released.append(request_id)
        self.inner.release(request_id)


@pytest.mark.parametrize("index", range(3))
def test_simulation_conserves_memory_and_releases_each_request_once(index):
    trace = make_workload(3_000, arrival_rate_for_load(1.1, 60_000), seed=5)
    audited = Audited(three_allocators(60_000)[index])
    result = simulate(trace, audited, warmup=5.0)
    assert sorted(audited.released) == sorted(audited.admitted)
    assert len(set(audited.released)) == len(audited.released)
    assert set(np.flatnonzero(result.admitted)) == audited.admitted
    assert audited.inner.held_tokens == 0 and not audited.inner.live
    assert len(result.refusal_occupancy) == len(result.refused)
    assert np.all(result.refusal_occupancy <= 1.0)
    assert 0 < result.refusal_rate < 1


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
def test_same_seed_same_numbers():
    def run(seed):
        trace = make_workload(4_000, arrival_rate_for_load(1.0, 50_000), seed=seed)
        return [simulate(trace, allocator, warmup=5.0) for allocator in three_allocators(50_000)]

    for a, b in zip(run(11), run(11)):
        np.testing.assert_array_equal(a.admitted, b.admitted)
        np.testing.assert_array_equal(a.refusal_occupancy, b.refusal_occupancy)
        assert pool_shares(a) == pool_shares(b)
    assert any(not np.array_equal(a.admitted, b.admitted) for a, b in zip(run(11), run(12)))


def test_simulate_releases_everything_when_the_allocator_raises():
    reservation = MaxLengthReservation(8_192, max_model_len=2_048)
    bad = Workload([0.0, 1.0, 2.0, 3.0], [0, 0, 0, 0], [10, 20, 3_000, 10], decode_rate=1.0)
    with pytest.raises(ValueError, match="max_model_len"):
        simulate(bad, reservation)  # the third request is longer than the limit
    assert not reservation.live and reservation.held_tokens == 0
    assert reservation.requested_tokens == 0
    good = Workload([0.0, 1.0, 2.0, 3.0, 4.0], [0] * 5, [5] * 5, decode_rate=1.0)
    result = simulate(good, reservation)  # all four slots free again: only the fifth is refused
    assert result.admitted.tolist() == [True, True, True, True, False]


def test_simulate_needs_an_empty_allocator():
    allocator = ExactFit(100)
    allocator.admit(99, 10)
    with pytest.raises(ValueError, match="allocator"):
        simulate(make_workload(10, 1.0), allocator)


@pytest.mark.parametrize("warmup", [-1.0, float("nan"), float("inf"), "last", "beyond", True])
def test_warmup_must_leave_a_window(warmup):
    trace = make_workload(50, 5.0, seed=3)
    last = float(trace.arrival_times[-1])
    warmup = {"last": last, "beyond": last + 10.0}.get(warmup, warmup)
    with pytest.raises(ValueError, match="warmup"):
        simulate(trace, ExactFit(1_000_000), warmup=warmup)
    result = simulate(trace, ExactFit(1_000_000), warmup=last - 1e-9)  # the last arrival alone
    assert result.refusal_rate == 0 and result.refused_token_seconds == 0


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_refused_token_seconds_against_a_loop():
    trace = make_workload(3_000, arrival_rate_for_load(1.2, 40_000), seed=8)
    for allocator in three_allocators(40_000):
        result = simulate(trace, allocator, warmup=10.0)
        offered = refused = 0.0
        for i in range(trace.num_requests):
            if trace.arrival_times[i] >= 10.0:
                weight = trace.total_lens[i] * trace.answer_lens[i] / trace.decode_rate
                offered += weight
                refused += 0.0 if result.admitted[i] else weight
        assert result.refused_token_seconds == pytest.approx(refused / offered)
        assert 0 < result.refused_token_seconds < 1


def test_external_refusals_are_counted_apart():
    # Lengths 4, 40 and 2 fill a 46-token pool; the short ones finish and leave gaps of 4 and 2,
    # so a request of 6 finds 6 tokens free but no run of 6.
    trace = Workload(np.array([0.0, 0.1, 0.2, 10.0]), np.array([0, 0, 0, 5]),
                     np.array([4, 40, 2, 1]), decode_rate=1.0)
    exact = simulate(trace, ExactFit(46))
    blocks = simulate(trace, BlockAllocator(46, 1))
    assert exact.refused.tolist() == [3] and exact.external_refusals == 1
    assert exact.refusal_free.tolist() == [6]
    assert blocks.refused.tolist() == [] and blocks.external_refusals == 0


def brute_force_pool(result, times):
    w, keep = result.workload, result.admitted
    held, written = np.zeros(len(times)), np.zeros(len(times))
    for i in np.flatnonzero(keep):
        a, e = w.arrival_times[i], w.finish_times[i]
        live = (times >= a) & (times < e)
        held += live * result.demands[i]
        written += live * (w.prompt_lens[i] + w.decode_rate * (times - a))
    return held / result.pool_tokens, written / result.pool_tokens


def test_pool_over_time_matches_brute_force():
    trace = make_workload(1_500, arrival_rate_for_load(0.9, 20_000), seed=2)
    result = simulate(trace, BlockAllocator(20_000, 16), warmup=3.0)
    times = np.linspace(0, trace.arrival_times[-1] + 5, 257)
    held, written = brute_force_pool(result, times)
    over_time = pool_over_time(result, times)
    np.testing.assert_allclose(over_time["held"], held, atol=1e-9)
    np.testing.assert_allclose(over_time["written"], written, atol=1e-6)
    assert np.all(over_time["written"] <= over_time["final length"] + 1e-9)
    assert np.all(over_time["final length"] <= over_time["held"] + 1e-9)


def test_pool_shares_are_the_time_average_of_the_pool():
    trace = make_workload(2_000, arrival_rate_for_load(0.8, 30_000), seed=4)
    result = simulate(trace, MaxLengthReservation(30_000, max_model_len=2048), warmup=4.0)
    shares = pool_shares(result)
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(share >= -1e-12 for share in shares.values())
    t0, t1 = result.window
    times = np.linspace(t0, t1, 200_001)
    over_time = pool_over_time(result, times)
    assert 1 - shares["free"] == pytest.approx(over_time["held"].mean(), abs=2e-3)
    assert shares["written"] == pytest.approx(over_time["written"].mean(), abs=2e-3)


@settings(max_examples=40, deadline=None)
@given(intervals=st.lists(st.tuples(st.floats(0, 10), st.floats(0, 5), st.integers(-5, 5)),
                          max_size=30),
       times=st.lists(st.floats(-1, 16), max_size=10))
def test_live_total_matches_brute_force(intervals, times):
    starts = np.array([s for s, _, _ in intervals], dtype=float)
    ends = starts + np.array([d for _, d, _ in intervals], dtype=float)
    values = np.array([v for _, _, v in intervals], dtype=float)
    times = np.array(times, dtype=float)
    expected = [sum(v for s, e, v in zip(starts, ends, values) if s <= t < e) for t in times]
    np.testing.assert_allclose(live_total(starts, ends, values, times), expected, atol=1e-9)


# ---------------------------------------------------------------- Erlang's loss formula


def test_erlang_b_known_values():
    assert erlang_b(0, 3.0) == 1.0
    assert erlang_b(1, 1.0) == pytest.approx(0.5)
    assert erlang_b(2, 1.0) == pytest.approx(0.2)  # (1/2) / (1 + 1 + 1/2)
    assert erlang_b(10, 0.0) == 0.0
    with pytest.raises(ValueError, match="servers"):
        erlang_b(-1, 1.0)
    with pytest.raises(ValueError, match="offered"):
        erlang_b(3, -1.0)
    with pytest.raises(ValueError, match="offered"):
        erlang_b(3, float("nan"))  # used to return nan
    with pytest.raises(ValueError, match="servers"):
        erlang_b(2.5, 1.0)


@pytest.mark.heavy
def test_reservations_refuse_as_erlang_predicts():
    """The reservation allocator is a loss system with pool // max_model_len servers."""
    load = 0.3
    rate = arrival_rate_for_load(load, STUDY_POOL_TOKENS)
    trace = make_workload(int(rate * 300), rate, seed=9)
    result = simulate(trace, MaxLengthReservation(STUDY_POOL_TOKENS), warmup=35.0)
    offered = rate * workload_moments()[0]
    refused = erlang_b(STUDY_POOL_TOKENS // 2048, offered)
    assert result.refusal_rate == pytest.approx(refused, abs=0.02)
    # Little's law on the admitted requests: A (1 - B) reservations live on average.
    held = 1 - pool_shares(result)["free"]
    assert held == pytest.approx(offered * (1 - refused) * 2048 / STUDY_POOL_TOKENS, abs=0.01)
    assert pool_shares(result)["written"] + pool_shares(result)["not yet written"] == (
        pytest.approx(load * (1 - result.refusal_rate), abs=0.02))


@pytest.mark.heavy
def test_the_seed_shape_on_the_seed_pool():
    """Moderate load: only reservations refuse. High load: exact fit refuses with room to spare."""
    for load, expect in ((0.28, "moderate"), (1.0, "high")):
        rate = arrival_rate_for_load(load, STUDY_POOL_TOKENS)
        trace = make_workload(int(rate * 150), rate, seed=0)
        results = {a.name: simulate(trace, a, warmup=35.0)
                   for a in three_allocators(STUDY_POOL_TOKENS)}
        if expect == "moderate":
            assert results["reservation"].refusal_rate > 0.05
            assert results["exact fit"].refusal_rate == 0 == results["blocks"].refusal_rate
        else:
            exact, blocks = results["exact fit"], results["blocks"]
            assert exact.refusal_rate > 0 and blocks.refusal_rate > 0
            assert exact.external_refusals == int(np.sum(exact.counted_refusals))
            assert blocks.external_refusals == 0
            assert np.max(exact.refusal_occupancy) < 0.97
            assert np.min(blocks.refusal_occupancy) > 1 - 2048 / STUDY_POOL_TOKENS


# ---------------------------------------------------------------- bad input, the whole catalogue


@pytest.mark.parametrize("call, field, attempt", bad_input_catalogue(),
                         ids=[call for call, _, _ in bad_input_catalogue()])
def test_every_catalogued_mistake_is_a_value_error_naming_its_argument(call, field, attempt):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        attempt()


def test_each_catalogued_text_is_the_call_its_entry_makes():
    # the chapter shows the text and the tests run the lambda: the same text, evaluated here,
    # must fail with the very same message
    import math

    from minipaged import fragmentation

    names = {**vars(fragmentation), "nan": math.nan, "inf": math.inf}
    for call, _, attempt in bad_input_catalogue():
        trace = fragmentation.Workload([0.0, 1.0], [1, 1], [1, 1], 1.0)
        with pytest.raises(ValueError) as by_text:
            eval(call, {**names, "trace": trace})  # noqa: S307 - the catalogue's own texts
        with pytest.raises(ValueError) as by_code:
            attempt()
        assert str(by_text.value) == str(by_code.value), call


@pytest.mark.parametrize("arrivals", [["0", "1"], [True, False], [0.0, None], [b"0", b"1"],
                                      np.array([0, 1], dtype=object)])
def test_arrivals_must_be_numbers_not_text_or_booleans(arrivals):
    with pytest.raises(ValueError, match="arrival_times"):
        Workload(arrivals, [1, 1], [1, 1], 1.0)
    assert Workload(np.array([0, 1], dtype=np.int32), [1, 1], [1, 1], 1.0).arrival_times.dtype \
        == np.float64  # integer seconds are numbers too


@pytest.mark.parametrize("share", [5, 0.5, "0.5", (0.1,), (0.1, 0.2, 0.3), ("0.2", "0.8"),
                                   (True, 0.5), (-0.1, 0.5), (0.6, 0.5), (0.2, float("nan")),
                                   None])
def test_prompt_share_must_be_a_pair_inside_the_unit_interval(share):
    for call in (lambda: make_workload(10, 1.0, prompt_share=share),
                 lambda: arrival_rate_for_load(1.0, 100, prompt_share=share),
                 lambda: workload_moments(prompt_share=share)):
        with pytest.raises(ValueError, match="prompt_share"):
            call()


def test_a_list_prompt_share_is_as_good_as_a_tuple():
    assert workload_moments(prompt_share=[0.2, 0.8]) == workload_moments()
    assert arrival_rate_for_load(1.0, 100, prompt_share=[0.2, 0.8]) == arrival_rate_for_load(
        1.0, 100)


@pytest.mark.parametrize("seed", ["abc", -1, 1.5, None, True])
def test_a_seed_numpy_would_reject_is_named(seed):
    with pytest.raises(ValueError, match="seed"):
        make_workload(10, 1.0, seed=seed)
    with pytest.raises(ValueError, match="seed"):
        sample_total_lengths(10, seed=seed)
    np.testing.assert_array_equal(make_workload(10, 1.0, seed=np.int64(3)).total_lens,
                                  make_workload(10, 1.0, seed=3).total_lens)


def test_an_exact_fit_pool_too_large_for_memory_is_refused_before_any_allocation():
    with pytest.raises(ValueError, match="pool_tokens"):
        MaxLengthReservation(2**40)
    with pytest.raises(ValueError, match="size"):
        MaxTree(2**40)
    with pytest.raises(ValueError, match="size"):
        MaxTree(0)
