"""Chapter 13: the reservation managers, the online driver's arrivals, and its latencies."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.blocks import BlockPool
from minipaged.engine import LLMEngine
from minipaged.memory import QWEN2_5_0_5B
from minipaged.model import ModelConfig, random_model
from minipaged.reckoning import decode_step_bytes
from minipaged.sampling import SamplingParams
from minipaged.scheduler import KVCacheManager, Request, Scheduler, needs_sample
from minipaged.serving import (
    CONTIGUOUS_ENGINES,
    SERVING_ENGINES,
    ContiguousMax,
    HostCost,
    MaxReservationManager,
    OracleReservationManager,
    Pow2ReservationManager,
    ReservationManager,
    ReservingScheduler,
    SimulatedEngine,
    StepCost,
    Trace,
    arrival_times,
    make_trace,
    projected_sweep,
    request_metrics,
    run_summary,
    serve,
    sustained_rate,
)

RESERVATIONS = [MaxReservationManager, Pow2ReservationManager, OracleReservationManager]


def reserved_tokens(manager_cls, prompt, output, max_model_len):
    """What each policy promises to reserve, written out independently of the classes."""
    final = min(prompt + output, max_model_len)
    if manager_cls is MaxReservationManager:
        return max_model_len
    if manager_cls is Pow2ReservationManager:  # the paper's: the output rounded up, not the prompt
        power = 1
        while power < output:
            power *= 2
        return min(prompt + power, max_model_len)
    return final


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(RESERVATIONS), st.integers(1, 300), st.integers(1, 300),
       st.sampled_from([1, 4, 16]), st.sampled_from([64, 256, 512]))
def test_each_manager_reserves_what_it_says_at_admission(manager_cls, prompt, output,
                                                         block_size, max_model_len):
    prompt = min(prompt, max_model_len - 1)
    output = min(output, max_model_len - prompt)
    pool = BlockPool(4 * max_model_len // block_size, block_size)
    scheduler = ReservingScheduler(manager_cls(pool), max_model_len=max_model_len)
    request = Request("r", [0] * prompt, SamplingParams(max_tokens=output))
    scheduler.add_request(request)
    scheduler.schedule()
    want = -(-reserved_tokens(manager_cls, prompt, output, max_model_len) // block_size)
    assert len(scheduler.kv_cache_manager.get_block_table(request).blocks) == want
    assert pool.get_num_free_blocks() == pool.num_blocks - want


@pytest.mark.parametrize("manager_cls", RESERVATIONS)
def test_a_reservation_is_admitted_only_when_all_of_it_fits(manager_cls):
    pool = BlockPool(40, 16)  # 640 tokens
    scheduler = ReservingScheduler(manager_cls(pool), max_model_len=256)
    requests = [Request(str(i), [0] * 100, SamplingParams(max_tokens=100)) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    each = -(-reserved_tokens(manager_cls, 100, 100, 256) // 16)
    admitted = len(scheduler.running)
    assert admitted == min(6, 40 // each)
    assert pool.get_num_free_blocks() == 40 - admitted * each
    assert admitted == 6 or pool.get_num_free_blocks() < each  # the next one waits whole


@pytest.mark.parametrize("name", [name for name, (manager_cls, _) in SERVING_ENGINES.items()
                                  if issubclass(manager_cls, ReservationManager)])
def test_reservation_engines_never_grow_and_never_preempt_under_load(name):
    manager_cls, scheduler_cls = SERVING_ENGINES[name]
    engine = SimulatedEngine(48, 16, 256, kv_cache_manager_cls=manager_cls,
                             scheduler_cls=scheduler_cls)
    trace = make_trace(80, rate=1e9, seed=3, max_model_len=256, median=60, mean=90)
    manager, held = engine.scheduler.kv_cache_manager, {}
    sizes = lambda: {rid: len(t.blocks) for rid, t in manager.block_tables.items()}  # noqa: E731
    for index in range(len(trace)):
        engine.add_request(str(index), [0] * int(trace.prompt_lens[index]),
                           SamplingParams(max_tokens=int(trace.output_lens[index]),
                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.execute(engine.scheduler.schedule())
        for rid, blocks in sizes().items():
            assert held.setdefault(rid, blocks) == blocks  # never grows
    assert engine.scheduler.num_preemptions == 0
    assert len(held) == len(trace)  # every request was admitted once, and finished
    assert engine.pool.get_num_free_blocks() == engine.pool.num_blocks


def test_the_same_trace_makes_the_paged_engine_preempt():
    engine = SimulatedEngine(48, 16, 256)  # the contrast: paged grows, so it can run dry
    trace = make_trace(80, rate=1e9, seed=3, max_model_len=256, median=60, mean=90)
    serve(engine, trace, step_seconds=lambda out: 1.0)
    assert engine.scheduler.num_preemptions > 0


def test_a_reservation_scheduler_refuses_to_preempt():
    scheduler = ReservingScheduler(OracleReservationManager(BlockPool(8, 16)), max_model_len=64)
    with pytest.raises(RuntimeError, match="never preempts"):
        scheduler.preempt(Request("r", [0], SamplingParams()), None)


def test_a_request_outgrowing_its_reservation_is_an_error():
    manager = OracleReservationManager(BlockPool(8, 4))
    manager.max_model_len = 32
    request = Request("r", [0] * 3, SamplingParams(max_tokens=2))  # 5 tokens: 2 blocks of 4
    assert len(manager.allocate_slots(request, 3)) == 2
    request.num_computed_tokens = 5
    with pytest.raises(RuntimeError, match="outgrew"):
        manager.allocate_slots(request, 4)


def test_poisson_arrivals_follow_the_rate():
    rate, n = 4.0, 40_000
    times = arrival_times(n, rate, seed=7)
    gaps = np.diff(times)
    # The mean gap of n exponential gaps has standard error (1 / rate) / sqrt(n): within 4 of them.
    assert abs(gaps.mean() - 1 / rate) < 4 * (1 / rate) / math.sqrt(n)
    # Counts in unit windows of a Poisson process: mean and variance both equal the rate.
    counts = np.bincount(times.astype(int))[:-1]
    assert abs(counts.mean() - rate) < 0.1 and abs(counts.var() / counts.mean() - 1) < 0.05
    # Exponential gaps: P(gap > t) = exp(-rate t), at a few t.
    for t in [0.1, 0.25, 0.5, 1.0]:
        assert abs((gaps > t).mean() - math.exp(-rate * t)) < 0.01


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    gaps = np.diff(arrival_times(40_000, 2.0, burstiness, seed=1))
    assert abs(gaps.mean() - 0.5) < 0.02
    assert abs(gaps.std() / gaps.mean() - burstiness ** -0.5) < 0.05


def test_arrivals_at_two_rates_are_one_trace_rescaled():
    assert np.allclose(arrival_times(50, 2.0, seed=4) * 2.0, arrival_times(50, 8.0, seed=4) * 8)


def test_trace_lengths_fit_the_window_and_do_not_depend_on_the_rate():
    slow, fast = make_trace(500, 1.0, max_model_len=256), make_trace(500, 9.0, max_model_len=256)
    assert np.array_equal(slow.prompt_lens, fast.prompt_lens)
    assert slow.prompt_lens.min() >= 1 and slow.output_lens.min() >= 1
    assert (slow.prompt_lens + slow.output_lens).max() <= 256


def test_latencies_of_a_tiny_run_match_the_hand_computation():
    trace = Trace(np.array([0.0, 0.0, 2.5]), np.array([4, 4, 4]), np.array([3, 1, 2]))
    run = serve(SimulatedEngine(8, 4, 16), trace, step_seconds=lambda out: 1.0)
    metrics = request_metrics(run)
    assert run.token_times == [[1.0, 2.0, 3.0], [1.0], [4.0, 5.0]]
    assert metrics["ttft"].tolist() == [1.0, 1.0, 1.5]
    assert metrics["e2e"].tolist() == [3.0, 1.0, 2.5]
    assert metrics["normalized"].tolist() == [1.0, 1.0, 1.25]
    assert np.isnan(metrics["tpot"][1]) and metrics["tpot"][[0, 2]].tolist() == [1.0, 1.0]
    assert metrics["itl"].tolist() == [1.0, 1.0, 1.0]
    assert run.batch_sizes.tolist() == [2, 1, 1, 1, 1]
    assert run.used_tokens.tolist() == [8, 5, 6, 4, 5]


def test_latencies_follow_from_the_steps_the_run_took():
    """Replay the run's own steps by hand: with every request there from the start, a token's
    time is the sum of the step times up to the step that sampled it."""
    trace = make_trace(30, rate=1e9, seed=2, max_model_len=128, median=20, mean=30)
    sampled_by_step = []

    def cost(out):
        sampled_by_step.append([r.request_id for r in out.scheduled_requests
                                if needs_sample(r, out.num_scheduled_tokens[r.request_id])])
        return 0.003 + 1e-5 * out.total_num_scheduled_tokens

    run = serve(SimulatedEngine(64, 16, 128, max_num_batched_tokens=64), trace, cost)
    clock, by_hand = 0.0, {str(i): [] for i in range(len(trace))}
    for ids, seconds in zip(sampled_by_step, run.step_seconds):
        clock += seconds
        for request_id in ids:
            by_hand[request_id].append(clock)
    assert run.token_times == [by_hand[str(i)] for i in range(len(trace))]
    metrics = request_metrics(run)
    first = np.array([by_hand[str(i)][0] for i in range(len(trace))])
    last = np.array([by_hand[str(i)][-1] for i in range(len(trace))])
    assert np.allclose(metrics["ttft"], first - trace.arrival_times)
    assert np.allclose(metrics["normalized"], (last - trace.arrival_times) / trace.output_lens)
    assert run_summary(run)["request_throughput"] == pytest.approx(len(trace) / last.max())


@pytest.mark.heavy  # seconds: a model's forward passes for every step
@pytest.mark.parametrize("name", list(SERVING_ENGINES))
def test_the_simulated_engine_schedules_as_the_real_engine_does(name):
    """With the same cost model, LLMEngine's forward passes and SimulatedEngine's stand-in
    tokens give the same token times: the schedule does not depend on the model."""
    manager_cls, scheduler_cls = SERVING_ENGINES[name]
    config = ModelConfig(64, 32, 32, 1, 2, 1, 16, 512)
    model = random_model(config, seed=0)
    trace = make_trace(16, rate=400.0, seed=5, max_model_len=128, median=20, mean=30)
    cost = StepCost(QWEN2_5_0_5B, HostCost(24, per_request_seconds=1e-4))
    options = dict(block_size=16, max_model_len=128, kv_cache_manager_cls=manager_cls,
                   scheduler_cls=scheduler_cls)
    real = serve(LLMEngine(model, num_gpu_blocks=24, max_num_batched_tokens=64, **options),
                 trace, cost)
    simulated = serve(SimulatedEngine(24, max_num_batched_tokens=64, **options), trace, cost)
    assert real.token_times == simulated.token_times
    assert real.held_tokens.tolist() == simulated.held_tokens.tolist()


def test_step_cost_is_bytes_over_bandwidth_plus_flops_over_peak_plus_host():
    scheduler = Scheduler(KVCacheManager(BlockPool(64, 16)), max_model_len=512)
    for name, prompt in [("a", 30), ("b", 70)]:
        scheduler.add_request(Request(name, [0] * prompt, SamplingParams()))
    out = scheduler.schedule()
    host = HostCost(24, kernels_per_layer=10, launch_seconds=1e-5, per_request_seconds=2e-5)
    cost = StepCost(QWEN2_5_0_5B, host)
    moved = sum(decode_step_bytes(QWEN2_5_0_5B, 1, 100).values())
    flops = 2 * QWEN2_5_0_5B.num_params * 100
    host_seconds = 24 * 10 * 1e-5 + 2 * 2e-5  # launches, plus two running requests
    assert cost(out) == pytest.approx(moved / 320e9 + flops / 65e12 + host_seconds)
    assert StepCost(QWEN2_5_0_5B, host.scaled(0))(out) == pytest.approx(moved / 320e9
                                                                         + flops / 65e12)


def test_pow2_reserves_the_prompt_plus_a_power_of_two_of_the_output():
    """The paper's Orca (Pow2): 100 + 60 reserves 100 + 64 = 164 tokens, not 256."""
    manager = Pow2ReservationManager(BlockPool(256, 16))
    manager.max_model_len = 2048
    assert manager.reservation_tokens(Request("r", [0] * 100, SamplingParams(max_tokens=60))) == 164
    assert manager.reservation_tokens(Request("r", [0] * 100, SamplingParams(max_tokens=25))) == 132
    manager.max_model_len = 1000
    capped = Request("r", [0] * 700, SamplingParams(max_tokens=300))  # 700 + 512 > 1000
    assert manager.reservation_tokens(capped) == 1000


@pytest.fixture(scope="module")
def scarce_sweeps():
    """The chapter's projected sweep of the scarce pool, at 1,000 and 2,000 requests."""
    fractions = [2 ** (k / 2) for k in range(-6, 5)]
    return {n: projected_sweep(8 * 2048 // 16, fractions, n) for n in (1000, 2000)}


@pytest.mark.slow  # about half a minute of simulated scheduling
def test_no_engine_sustains_more_than_its_throughput_with_the_queue_full(scarce_sweeps):
    for result in scarce_sweeps.values():
        for name in SERVING_ENGINES:
            assert result["sustained"][name] <= result["flood"][name], name
            # the latency and keeping-up crossing itself, before the cap: within 5% of it
            assert result["crossing"][name] <= 1.05 * result["flood"][name], name


@pytest.mark.slow
def test_the_ratios_hold_when_the_trace_doubles(scarce_sweeps):
    short, long = (scarce_sweeps[n]["sustained"] for n in (1000, 2000))
    first = next(iter(SERVING_ENGINES))
    for name in list(SERVING_ENGINES)[1:]:
        ratio_short, ratio_long = short[first] / short[name], long[first] / long[name]
        assert ratio_long == pytest.approx(ratio_short, rel=0.10), name


def test_sustained_rate_interpolates_the_crossing_on_log_latency():
    rates, latencies = [1.0, 2.0, 4.0], [0.1, 0.1, 0.4]
    assert sustained_rate(rates, latencies, 0.2) == pytest.approx(3.0)  # halfway in log
    assert sustained_rate(rates, latencies, 1.0) == 4.0  # never over: the last rate tested
    assert sustained_rate(rates, latencies, 0.05) == 0.0  # over from the first


@pytest.mark.parametrize(("field", "call"), [
    ("rate", lambda: arrival_times(5, 0.0)),
    ("rate", lambda: arrival_times(5, float("inf"))),
    ("burstiness", lambda: arrival_times(5, 1.0, burstiness=-1)),
    ("num_requests", lambda: make_trace(0, 1.0)),
    ("seed", lambda: make_trace(3, 1.0, seed=-2)),
    ("max_model_len", lambda: make_trace(3, 1.0, max_model_len=1)),
    ("trace", lambda: serve(SimulatedEngine(8, 4, 16), "trace")),
    ("engine", lambda: serve(object(), make_trace(2, 1.0))),
    ("step_seconds", lambda: serve(SimulatedEngine(8, 4, 16), make_trace(2, 1.0), 0.5)),
    ("num_gpu_blocks", lambda: SimulatedEngine(3, 16, 64)),
    ("max_num_seqs", lambda: SimulatedEngine(8, 16, 64, max_num_seqs=0)),
    ("bound", lambda: sustained_rate([1.0], [0.1], -1.0)),
    ("rates", lambda: sustained_rate([1.0, 1.0], [0.1, 0.2], 1.0)),
])
def test_bad_input_names_the_field(field, call):
    with pytest.raises(ValueError, match=field):
        call()


@pytest.mark.heavy  # seconds: a model's forward passes for every step
def test_reservation_engines_run_on_the_real_engine():
    model = random_model(ModelConfig(64, 32, 32, 1, 2, 1, 16, 512), seed=1)
    manager_cls, scheduler_cls = SERVING_ENGINES["Pow2"]
    engine = LLMEngine(model, num_gpu_blocks=16, block_size=16, max_model_len=128,
                       kv_cache_manager_cls=manager_cls, scheduler_cls=scheduler_cls)
    run = serve(engine, make_trace(10, 1e9, max_model_len=128, median=20, mean=30))
    assert [len(t) for t in run.token_times] == run.trace.output_lens.tolist()
    assert engine.scheduler.num_preemptions == 0


def test_a_contiguous_reservation_is_one_run_and_waits_for_a_run_long_enough():
    """First fit: adjacent blocks; a request whose run does not exist waits although enough
    blocks are free in total (external fragmentation)."""
    pool = BlockPool(12, 16)
    scheduler = ReservingScheduler(ContiguousMax(pool), max_model_len=64)  # 4 blocks each
    requests = [Request(str(i), [0] * 10, SamplingParams(max_tokens=5)) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()
    manager = scheduler.kv_cache_manager
    ids = [[b.block_id for b in manager.get_block_table(r).blocks] for r in requests]
    assert ids == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    manager.free(requests[0])
    manager.free(requests[2])
    held = Request("h", [0] * 10, SamplingParams(max_tokens=5))
    assert manager.can_admit(held)  # a run of four at the start
    assert manager.allocate_slots(held, 10) is not None
    manager.free(requests[1])  # free: 4..11, one run of eight
    assert manager.first_fit(held)[0] == 4


def test_every_contiguous_engine_serves_a_trace_without_preempting():
    for manager_cls, scheduler_cls in CONTIGUOUS_ENGINES.values():
        engine = SimulatedEngine(64, 16, 256, kv_cache_manager_cls=manager_cls,
                                 scheduler_cls=scheduler_cls)
        run = serve(engine, make_trace(60, 50.0, max_model_len=256, median=40, mean=60),
                    step_seconds=lambda out: 0.01)
        assert [len(t) for t in run.token_times] == run.trace.output_lens.tolist()
        assert engine.scheduler.num_preemptions == 0
        assert engine.pool.get_num_free_blocks() == 64
        assert bytes(engine.scheduler.kv_cache_manager.free_map) == b"\x01" * 64


def test_the_t4_clock_predicts_the_studys_starved_over_ample_loss():
    """The study's 200 requests of 9 + 1,000 tokens on its ample and starved pools: the clock's
    throughput lost to the starved pool within 10 points of the study's, and each throughput
    within the chapter's factor of 3 (the clock prices the card at its peaks: fast)."""
    from minipaged.reckoning import STUDY

    def tps(pool_tokens):
        trace = Trace(np.zeros(200), np.full(200, 9), np.full(200, 1000))
        run = serve(SimulatedEngine(pool_tokens // 16, 16, 2048), trace,
                    step_seconds=StepCost(QWEN2_5_0_5B))
        return run_summary(run)["output_throughput"]

    ample, starved = tps(STUDY["t4_tokens_85"].study), tps(STUDY["starved_pool"].study)
    lost = 100 * (1 - starved / ample)
    assert abs(lost - STUDY["starved_slowdown"].study) <= 10
    assert 1 <= ample / STUDY["ample_tps"].study <= 3
    assert 1 <= starved / STUDY["starved_tps"].study <= 3
