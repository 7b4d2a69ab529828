"""Issue 46: chapter 13's serving functions and the step players refuse bad input by name,
before anything changes, and never hang; a refused call leaves a live engine to finish its
earlier requests with the same answers."""
import importlib
import pkgutil
import signal
import warnings

import numpy as np
import pytest
import torch

import minipaged
from minipaged import serving as S
from minipaged.blocks import BlockPool, BlockTable
from minipaged.engine import LLMEngine
from minipaged.engine_player import EngineRecorder
from minipaged.memory import QWEN2_5_0_5B, ModelShape
from minipaged.model import ModelConfig, random_model
from minipaged.player import StepRecorder, StepState, show_steps
from minipaged.sampling import SamplingParams
from minipaged.scheduler import KVCacheManager, Request
from minipaged.serving import (
    HostCost,
    OracleReservationManager,
    ReservationManager,
    ReservingScheduler,
    SimulatedEngine,
    StepCost,
    Trace,
    arrival_times,
    make_trace,
    request_metrics,
    run_summary,
    serve,
    sustained_rate,
)

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def no_hang():
    """Each test here fails, instead of hanging, after 60 s (serve once looped forever)."""
    def hung(signum, frame):
        raise TimeoutError("the call did not return in 60 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def engine():
    return SimulatedEngine(64, 16, 256)


def trace(arrivals=(0.0, 1.0), prompts=(4, 4), outputs=(3, 3)):
    return Trace(np.array(arrivals), np.array(prompts), np.array(outputs))


def small_trace():
    return make_trace(4, 2.0, max_model_len=256, median=20, mean=30)


# --- traces: columns that agree, finite times in order, whole lengths of a token or more ---
@pytest.mark.parametrize(("field", "call"), [
    ("arrival_times", lambda: trace((0.0, NAN))),
    ("arrival_times", lambda: trace((0.0, INF))),
    ("arrival_times", lambda: trace((1.0, 0.0))),
    ("arrival_times", lambda: trace((-1.0, 0.0))),
    ("arrival_times", lambda: trace((), (), ())),
    ("arrival_times", lambda: Trace("0 1", np.array([4, 4]), np.array([3, 3]))),
    ("arrival_times", lambda: Trace(np.zeros((2, 1)), np.array([4, 4]), np.array([3, 3]))),
    ("prompt_lens", lambda: trace((0.0, 1.0, 2.0))),  # 3 arrivals, 2 lengths
    ("prompt_lens", lambda: trace((0.0, 1.0), (4, 4, 4), (3, 3, 3))),
    ("prompt_lens", lambda: trace(prompts=(0, 4))),
    ("prompt_lens", lambda: trace(prompts=(4.0, 4.0))),
    ("prompt_lens", lambda: trace(prompts=(True, True))),
    ("output_lens", lambda: trace(outputs=(3, -1))),
    ("output_lens", lambda: trace(outputs=(3,))),
    ("output_lens", lambda: trace(outputs=(2.5, 3.0))),
])
def test_a_trace_is_checked_when_made(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def test_a_trace_takes_lists_and_keeps_arrays():
    made = Trace([0, 1], [4, 4], [3, 3])
    assert made.arrival_times.dtype == float and made.prompt_lens.dtype.kind == "i"
    assert len(made) == 2


@pytest.mark.parametrize(("rate", "burstiness"), [(1e-320, 1.0), (1.0, 1e-320), (5e-324, 1.0)])
def test_arrival_times_too_spread_for_a_float_are_refused(rate, burstiness):
    with pytest.raises(ValueError, match="rate"):
        arrival_times(5, rate, burstiness)


# --- serve: a step's time, a busy engine, a prompt past the limit; never a hang ---
def test_serve_refuses_an_arrival_changed_to_nan_after_the_trace_was_made():
    made = trace()
    made.arrival_times[1] = NAN  # the arrays stay writable: serve checks them again
    with pytest.raises(ValueError, match="arrival_times"):
        serve(engine(), made, lambda out: 0.1)


@pytest.mark.parametrize("took", [-1.0, NAN, INF, "0.1", None, True])
def test_a_step_time_that_is_not_finite_and_non_negative_is_refused_at_that_step(took):
    with pytest.raises(ValueError, match=r"step_seconds\(out\).*clock 0 s, 1 of 4 arrived"):
        serve(engine(), small_trace(), lambda out: took)


def test_a_clock_that_runs_backwards_is_refused():
    readings = iter(range(10**6, 0, -1))
    with pytest.raises(ValueError, match="clock"):
        serve(engine(), small_trace(), clock=lambda: next(readings))


def test_a_clock_that_stands_still_still_ends():
    run = serve(engine(), small_trace(), clock=lambda: 0.0)  # every step took 0 s
    assert all(run.token_times) and not run.step_seconds.any()


@pytest.mark.parametrize(("field", "call"), [
    ("clock", lambda: serve(engine(), small_trace(), clock=None)),
    ("step_seconds", lambda: serve(engine(), small_trace(), step_seconds="fast")),
    ("engine", lambda: serve(None, small_trace())),
    ("engine", lambda: serve(BlockPool(8, 4), small_trace())),
    ("trace", lambda: serve(engine(), [(0.0, 4, 3)])),
    ("max_model_len", lambda: serve(SimulatedEngine(8, 4, 16), small_trace())),
])
def test_serve_refuses_its_arguments_by_name(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def test_serve_refuses_a_busy_engine_at_once_and_the_engine_finishes_its_own():
    busy = engine()
    busy.add_request("p0", [0] * 4, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="engine still holds requests"):
        serve(busy, small_trace(), lambda out: 0.1)
    assert busy.num_steps == 0 and list(busy.requests) == ["p0"]
    while busy.has_unfinished_requests():
        busy.execute(busy.scheduler.schedule())
    assert busy.num_steps == 3 and busy.pool.get_num_free_blocks() == busy.pool.num_blocks


def test_a_run_served_after_every_refusal_matches_a_clean_one():
    served = engine()
    for bad in [lambda: serve(served, small_trace(), lambda out: -1.0),
                lambda: serve(served, "trace")]:
        with pytest.raises(ValueError):
            bad()
        while served.has_unfinished_requests():  # a step refused mid-run: finish it off
            served.execute(served.scheduler.schedule())
    assert served.pool.get_num_free_blocks() == served.pool.num_blocks and not served.requests
    again = serve(served, small_trace(), lambda out: 0.1)
    clean = serve(engine(), small_trace(), lambda out: 0.1)
    assert again.token_times == clean.token_times


@pytest.mark.parametrize("call", [lambda: request_metrics("run"), lambda: run_summary(None)])
def test_the_metrics_read_a_serving_run_only(call):
    with pytest.raises(ValueError, match="run must be a ServingRun"):
        call()


# --- sustained_rate: rates and latencies finite and positive, one latency per rate ---
@pytest.mark.parametrize(("field", "rates", "latencies", "bound"), [
    ("latencies", [1, 2, 3], [0.1, NAN, 0.4], 0.3),
    ("latencies", [1, 2, 3], [0.1, -0.2, 0.4], 0.3),
    ("latencies", [1, 2, 3], [0.1, 0.0, 0.4], 0.3),
    ("latencies", [1, 2, 3], [0.1, INF, 0.4], 0.3),
    ("rates", [1, NAN, 3], [0.1, 0.2, 0.4], 0.3),
    ("rates", [-1, 2, 3], [0.1, 0.2, 0.4], 0.3),
    ("rates", [[1, 2, 3]], [[0.1, 0.2, 0.4]], 0.3),
    ("rates", [1, 2], [0.1, 0.2, 0.4], 0.3),
    ("rates", [], [], 0.3),
    ("rates", "123", [0.1, 0.2, 0.4], 0.3),
    ("bound", [1, 2, 3], [0.1, 0.2, 0.4], NAN),
])
def test_sustained_rate_refuses_what_it_cannot_interpolate(field, rates, latencies, bound):
    with pytest.raises(ValueError, match=field):
        sustained_rate(rates, latencies, bound)


# --- the simulated engine refuses what chapter 7's engine refuses, with its messages ---
@pytest.fixture(scope="module")
def real_engine():
    model = random_model(ModelConfig.small(num_layers=1), seed=0, dtype=torch.float32,
                         device="cpu")
    return LLMEngine(model, 64, 16, 256)


BAD_REQUESTS = [  # (request_id, prompt_token_ids, sampling_params)
    ("a", [0] * 300, SamplingParams()),
    ("a", [], SamplingParams()),
    ("a", [0], None),
    ("a", [0], {"max_tokens": 3}),
    (7, [0], SamplingParams()),
    ("a", "0 1", SamplingParams()),
    ("a", 5, SamplingParams()),
    ("a", [0.0, 1.0], SamplingParams()),
    ("a", [True], SamplingParams()),
    ("a", [-1], SamplingParams()),  # the simulated engine has no vocabulary: its bound is inf
]


@pytest.mark.parametrize("request_args", BAD_REQUESTS)
def test_the_simulated_engine_refuses_a_request_as_the_real_one_does(real_engine, request_args):
    with pytest.raises(ValueError) as real:
        real_engine.add_request(*request_args)
    simulated = engine()
    with pytest.raises(ValueError) as ours:
        simulated.add_request(*request_args)
    bound = str(real_engine.config.vocab_size)
    assert str(ours.value) == str(real.value).replace(bound, "inf")
    assert not simulated.has_unfinished_requests() and not real_engine.has_unfinished_requests()


def test_the_simulated_engine_refuses_a_live_id_and_n_above_one():
    simulated = engine()
    simulated.add_request("a", [0], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id 'a' is already in the engine"):
        simulated.add_request("a", [0], SamplingParams())
    with pytest.raises(ValueError, match="sampling_params.n must be 1"):
        simulated.add_request("b", [0], SamplingParams(n=2))
    assert list(simulated.requests) == ["a"]
    while simulated.has_unfinished_requests():
        simulated.execute(simulated.scheduler.schedule())
    simulated.add_request("a", [0], SamplingParams())  # finished: its id is free again


@pytest.mark.parametrize(("field", "options"), [
    ("kv_cache_manager_cls", dict(kv_cache_manager_cls=int)),
    ("kv_cache_manager_cls", dict(kv_cache_manager_cls=OracleReservationManager(BlockPool(4, 16)))),
    ("scheduler_cls", dict(scheduler_cls=dict)),
    ("kv_cache_manager", dict(scheduler_cls=ReservingScheduler)),  # the paged manager grows
])
def test_the_simulated_engine_refuses_parts_as_the_real_one_does(real_engine, field, options):
    with pytest.raises(ValueError, match=field):
        SimulatedEngine(64, 16, 256, **options)
    if field.endswith("_cls"):
        with pytest.raises(ValueError, match=field) as real:
            LLMEngine(real_engine.model, 64, 16, 256, **options)
        with pytest.raises(ValueError) as ours:
            SimulatedEngine(64, 16, 256, **options)
        assert str(ours.value) == str(real.value)


def test_execute_and_a_step_cost_read_a_scheduler_output_only():
    with pytest.raises(ValueError, match="out must be"):
        engine().execute(None)
    with pytest.raises(ValueError, match="out must be"):
        StepCost(QWEN2_5_0_5B)([1, 2])


@pytest.mark.parametrize(("field", "options"), [
    ("shape", dict(shape="qwen")),
    ("num_params", dict(shape=ModelShape("no count", 2, 2, 2, 8))),
    ("host", dict(shape=QWEN2_5_0_5B, host=-1.0)),
    ("host", dict(shape=QWEN2_5_0_5B, host="fast")),
    ("bytes_per_s", dict(shape=QWEN2_5_0_5B, bytes_per_s=0)),
    ("flops_per_s", dict(shape=QWEN2_5_0_5B, flops_per_s=INF)),
])
def test_a_step_cost_is_checked_when_made(field, options):
    with pytest.raises(ValueError, match=field):
        StepCost(**options)


@pytest.mark.parametrize(("field", "options"), [
    ("num_layers", dict(num_layers=0)), ("num_layers", dict(num_layers=2.5)),
    ("kernels_per_layer", dict(num_layers=24, kernels_per_layer=-1)),
    ("launch_seconds", dict(num_layers=24, launch_seconds=NAN)),
    ("per_request_seconds", dict(num_layers=24, per_request_seconds=-1e-6)),
])
def test_a_host_cost_is_checked_when_made(field, options):
    with pytest.raises(ValueError, match=field):
        HostCost(**options)


# --- every manager in the package answers a successful allocation with a true value ---
def package_managers() -> list[type]:
    for module in pkgutil.iter_modules(minipaged.__path__):
        if not module.name.startswith("exercises"):
            importlib.import_module(f"minipaged.{module.name}")
    found, todo = [], [KVCacheManager]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        abstract = issubclass(cls, ReservationManager) and (
            cls.reservation_tokens is ReservationManager.reservation_tokens)  # no policy yet
        if cls.__module__.startswith("minipaged.") and not abstract:
            found.append(cls)
    return sorted(set(found), key=lambda cls: cls.__qualname__)


def test_the_package_has_the_managers_it_should():
    names = {cls.__name__ for cls in package_managers()}
    assert {"KVCacheManager", "PrefixCachingKVCacheManager", "OracleReservationManager",
            "Pow2ReservationManager", "MaxReservationManager"} <= names


@pytest.mark.parametrize("manager_cls", package_managers(), ids=lambda cls: cls.__name__)
def test_every_manager_answers_success_with_a_true_value(manager_cls):
    manager = manager_cls(manager_cls.pool_class(16, 4))
    manager.max_model_len = 64  # the reservation managers' limit; the others ignore it
    request = Request("r", list(range(6)), SamplingParams(max_tokens=4))
    for computed, new in [(0, 6), (6, 1), (7, 1), (8, 1)]:  # admission, then decode steps
        request.num_computed_tokens = computed
        assert manager.allocate_slots(request, new), (computed, new)


def test_an_oracle_decode_step_is_true():
    manager = OracleReservationManager(BlockPool(8, 4))
    manager.max_model_len = 32
    request = Request("r", [0] * 3, SamplingParams(max_tokens=2))
    assert len(manager.allocate_slots(request, 3)) == 2
    request.num_computed_tokens = 3
    assert manager.allocate_slots(request, 1)


# --- the reservation engines' own RuntimeErrors, met only by a policy of the reader's ---
def test_a_policy_that_reserves_too_little_outgrows_its_reservation():
    class PromptOnly(ReservationManager):
        def reservation_tokens(self, request):
            return request.num_prompt_tokens

    short = SimulatedEngine(8, 4, 16, kv_cache_manager_cls=PromptOnly,
                            scheduler_cls=ReservingScheduler)
    short.add_request("r", [0] * 4, SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="outgrew its reservation of 4 tokens"):
        for _ in range(3):
            short.execute(short.scheduler.schedule())
    with pytest.raises(RuntimeError, match="never preempts"):
        short.scheduler.preempt(short.requests["r"], None)


# --- issue 46c: the last sweep's findings in serving.py ---
RESERVING = [name for name, (manager_cls, _) in S.SERVING_ENGINES.items()
             if issubclass(manager_cls, ReservationManager)]


@pytest.mark.parametrize("name", RESERVING)
def test_max_tokens_none_is_bounded_by_the_context_limit_and_served(name):
    manager_cls, scheduler_cls = S.SERVING_ENGINES[name]
    manager = manager_cls(BlockPool(32, 16))
    request = Request("r", [0] * 10, SamplingParams(max_tokens=None))
    assert manager.final_length(request) == manager.max_model_len  # as vLLM: up to the limit
    assert manager.reservation_tokens(request) == manager.max_model_len
    sim = SimulatedEngine(64, 16, 256, kv_cache_manager_cls=manager_cls,
                          scheduler_cls=scheduler_cls)
    made = sim.add_request("n", [1] * 10, SamplingParams(max_tokens=None, ignore_eos=True))
    for _ in range(300):
        if not sim.has_unfinished_requests():
            break
        sim.execute(sim.scheduler.schedule())
    assert not sim.has_unfinished_requests() and made.num_tokens == 256
    assert sim.pool.get_num_free_blocks() == 64


def oracle():
    return OracleReservationManager(BlockPool(32, 16))


def a_request(rid="r"):
    return Request(rid, [1] * 10, SamplingParams(max_tokens=4))


def test_reserving_twice_for_one_request_is_refused_and_leaks_nothing():
    manager, request = oracle(), a_request()
    S.reserve(manager, request)
    with pytest.raises(ValueError, match="already holds a reservation"):
        S.reserve(manager, request)
    manager.free(request)
    assert manager.pool.get_num_free_blocks() == 32


@pytest.mark.parametrize("count", [-1, None, "3", 1.5, True, NAN])
def test_a_reservation_refuses_a_bad_token_count_before_taking_blocks(count):
    for manager_cls in [OracleReservationManager, S.ContiguousOracle]:
        manager, request = manager_cls(BlockPool(32, 16)), a_request()
        with pytest.raises(ValueError, match="num_new_tokens"):
            manager.allocate_slots(request, count)
        assert manager.pool.get_num_free_blocks() == 32 and not manager.block_tables
        assert manager.allocate_slots(request, 10)
        with pytest.raises(ValueError, match="num_new_tokens"):
            manager.allocate_slots(request, count)


@pytest.mark.parametrize(("field", "call"), [
    ("request", lambda: oracle().reservation_tokens(None)),
    ("request", lambda: S.MaxReservationManager(BlockPool(32, 16)).reservation_tokens("r")),
    ("request", lambda: S.Pow2ReservationManager(BlockPool(32, 16)).can_admit(SamplingParams())),
    ("request", lambda: oracle().final_length(None)),
    ("request", lambda: oracle().allocate_slots(None, 5)),
    ("max_model_len", lambda: ReservingScheduler(oracle(), max_model_len=10**30)),
    ("max_model_len", lambda: ReservingScheduler(oracle(), max_model_len=32 * 16 + 1)),
    ("manager", lambda: S.reserve(None, a_request())),
    ("manager", lambda: S.reserve(KVCacheManager(BlockPool(8, 16)), a_request())),
    ("request", lambda: S.reserve(oracle(), None)),
    ("scheduler_cls", lambda: SimulatedEngine(64, 16, 256,
                                              kv_cache_manager_cls=S.MaxReservationManager)),
    ("scheduler_cls", lambda: SimulatedEngine(64, 16, 256, scheduler_cls=ReservingScheduler)),
    ("block_size", lambda: SimulatedEngine(64, 3, 256)),
    ("clock", lambda: serve(engine(), small_trace(), clock=lambda x: 1.0)),
    ("clock", lambda: serve(engine(), small_trace(), clock=None)),
    ("clock", lambda: serve(engine(), small_trace(), clock=lambda: 10**400)),
    ("step_seconds", lambda: serve(engine(), small_trace(), lambda: 0.1)),
    ("max_model_len", lambda: serve(engine(), trace(prompts=(200, 4), outputs=(100, 3)))),
    ("mean", lambda: make_trace(5, 2.0, median=1e-300, mean=1e300)),
    ("num_params", lambda: StepCost(ModelShape("t", 2, 14, 2, 64, 2, num_params=True))),
    ("bytes_per_s", lambda: StepCost(QWEN2_5_0_5B, bytes_per_s=1e-320)),
    ("flops_per_s", lambda: StepCost(QWEN2_5_0_5B, flops_per_s=1e-320)),
    ("batch", lambda: HostCost(2)(-1)),
    ("factor", lambda: HostCost(2).scaled(NAN)),
])
def test_the_last_sweep_s_findings_are_refused_by_name(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def test_a_numpy_parameter_count_is_a_count():
    shape = ModelShape("t", 2, 14, 2, 64, 2, num_params=np.int64(10**6))
    assert StepCost(shape) == StepCost(shape)


def live_engine():
    sim = engine()
    sim.add_request("a", [1] * 20, SamplingParams(max_tokens=5, ignore_eos=True))
    sim.add_request("b", [2] * 40, SamplingParams(max_tokens=3, ignore_eos=True))
    return sim


def drained(sim):
    while sim.has_unfinished_requests():
        sim.execute(sim.scheduler.schedule())
    return sim.num_steps, sim.pool.get_num_free_blocks()


@pytest.mark.parametrize("bad_out", [
    lambda sim, out: out,  # executed a second time
    lambda sim, out: live_engine().scheduler.schedule(),  # another engine's batch
    lambda sim, out: S.SchedulerOutput(out.scheduled_requests, {"a": -3, "b": 1}, []),
    lambda sim, out: S.SchedulerOutput(out.scheduled_requests, {}, []),
    lambda sim, out: S.SchedulerOutput([], {}, []),
])
def test_execute_refuses_a_batch_it_cannot_book_and_the_engine_finishes_as_a_clean_one(bad_out):
    clean, sim = live_engine(), live_engine()
    out = sim.scheduler.schedule()
    sim.execute(out)
    clean.execute(clean.scheduler.schedule())
    with pytest.raises(ValueError, match="out"):
        sim.execute(bad_out(sim, out))
    assert drained(sim) == drained(clean)


def test_a_step_cost_refuses_a_batch_of_negative_or_no_tokens():
    cost, out = StepCost(QWEN2_5_0_5B), live_engine().scheduler.schedule()
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        cost(S.SchedulerOutput(out.scheduled_requests, {"a": -3, "b": 1}, []))
    with pytest.raises(ValueError, match="out"):
        cost(S.SchedulerOutput([], {}, []))


def a_run():
    return serve(engine(), small_trace(), StepCost(QWEN2_5_0_5B))


@pytest.mark.parametrize(("field", "change"), [
    ("token_times", {"token_times": None}),
    ("token_times", {"token_times": [["a"]] * 4}),
    ("token_times", {"token_times": [[9.0]] * 4}),  # fewer tokens than the trace's outputs
    ("token_times", {"token_times": "backwards"}),
    ("step_seconds", {"step_seconds": None}),
    ("step_seconds", {"step_seconds": np.array([])}),
    ("batch_sizes", {"batch_sizes": np.array([1])}),
    ("held_tokens", {"held_tokens": None}),
])
def test_the_metrics_check_every_field_of_a_run(field, change):
    import dataclasses
    run = a_run()
    if change.get("token_times") == "backwards":
        change = {"token_times": [list(reversed(t)) if len(t) > 1 else [-1.0]
                                  for t in run.token_times]}
    bad = dataclasses.replace(run, **change)
    for read in (request_metrics, run_summary, S.steady_throughput, S.finish_over_arrival):
        with pytest.raises(ValueError, match=field):
            read(bad)


@pytest.mark.parametrize(("field", "call"), [
    ("warmup", lambda run: run_summary(run, warmup=4)),
    ("warmup", lambda run: run_summary(run, warmup=-1)),
    ("slo", lambda run: run_summary(run, slo={"latency": 1.0})),
    ("slo", lambda run: run_summary(run, slo={"ttft": NAN})),
    ("share", lambda run: S.steady_throughput(run, 0.5)),
    ("share", lambda run: S.finish_over_arrival(run, None)),
])
def test_a_summary_s_own_arguments_are_checked(field, call):
    with pytest.raises(ValueError, match=field):
        call(a_run())


def test_the_entry_checks_are_machinery_not_api():
    assert not [name for name in dir(S) if name.startswith(("check_", "as_column", "read_clock"))
                and getattr(S, name).__module__ == S.__name__]
    assert S.reserve and S.run_summary and S.SERVING_ENGINES  # what readers call stays public


# --- the players ---
def test_a_recorder_refuses_a_table_of_another_larger_pool():
    small, big = BlockPool(8, 4), BlockPool(32, 4)
    table = BlockTable(big)
    table.blocks += big.get_new_blocks(20)
    with pytest.raises(ValueError, match=r"block_tables\['a'\] is a table of another pool"):
        StepRecorder(small, {"a": table})
    tables = {}
    recorder = StepRecorder(small, tables)
    tables["a"] = table  # the mapping is live: a table that joins it later is read again
    with pytest.raises(ValueError, match=r"block_tables\['a'\] is a table of another pool"):
        recorder.record()
    assert recorder.trace == []


@pytest.mark.parametrize(("field", "call"), [
    ("pool", lambda: StepRecorder(None, {})),
    ("block_tables", lambda: StepRecorder(BlockPool(4, 4), [])),
    (r"block_tables\['a'\]", lambda: StepRecorder(BlockPool(4, 4), {"a": [1, 2]}).record()),
    ("events", lambda: StepRecorder(BlockPool(4, 4), {}).record(3)),
])
def test_a_recorder_refuses_what_it_cannot_read(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def one_state(num_blocks=8, **fields) -> StepState:
    state = StepRecorder(BlockPool(num_blocks, 4), {}).record()
    return StepState(**{**state.__dict__, **fields})


@pytest.mark.parametrize(("field", "call"), [
    (r"trace\[0\] must be a StepState", lambda: show_steps([1, 2])),
    ("trace must be a list", lambda: show_steps("steps")),
    ("trace must be a list", lambda: show_steps(None)),
    ("no step", lambda: show_steps([])),
    ("one pool", lambda: show_steps([one_state(8), one_state(32)])),
    (r"tables\['a'\] holds block 9", lambda: show_steps([one_state(tables={"a": (9,)})])),
    ("free_queue", lambda: show_steps([one_state(free_queue=(0, -1))])),
    ("events must be a tuple of strings", lambda: show_steps([one_state(events=(1,))])),
    ("more_tables", lambda: show_steps([one_state(more_tables={"host": {"x": (0,)}})])),
    ("start", lambda: show_steps([one_state()], start=True)),
    ("start", lambda: show_steps([one_state()], start=1)),
    ("caption", lambda: show_steps([one_state()], caption=3)),
    ("alt", lambda: show_steps([one_state()], alt=None)),
])
def test_a_player_refuses_a_trace_it_could_not_draw(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def test_a_trace_of_one_pool_is_drawn():
    assert "<svg" in show_steps([one_state(), one_state()], start=1)._repr_html_()


@pytest.mark.parametrize("not_an_engine", [None, "engine", SimulatedEngine(64, 16, 256)])
def test_an_engine_recorder_needs_an_engine(not_an_engine):
    with pytest.raises(ValueError, match="engine must be an LLMEngine"):
        EngineRecorder(not_an_engine)


@pytest.mark.parametrize("max_steps", [0, -1, 2.5, True, "3", None])
def test_an_engine_recorder_refuses_a_step_count_and_its_engine_finishes(real_engine, max_steps):
    real_engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    recorder = EngineRecorder(real_engine)
    with pytest.raises(ValueError, match="max_steps"):
        recorder.run(max_steps=max_steps)
    assert recorder.trace == [] and real_engine.requests["x"].num_computed_tokens == 0
    recorder.run()
    assert not real_engine.has_unfinished_requests()
    assert real_engine.pool.get_num_free_blocks() == real_engine.pool.num_blocks


def test_a_refused_request_leaves_the_real_engine_to_give_the_same_answer(real_engine):
    def answer(refuse: bool) -> list[int]:
        request = real_engine.add_request("same", [1, 2, 3], SamplingParams(max_tokens=5))
        if refuse:
            for args in BAD_REQUESTS:
                with pytest.raises(ValueError):
                    real_engine.add_request(*args)
            with pytest.raises(ValueError):
                EngineRecorder(real_engine).run(max_steps=0)
        while real_engine.has_unfinished_requests():
            real_engine.step()
        return list(request.output_token_ids)

    assert answer(refuse=True) == answer(refuse=False)
    assert real_engine.pool.get_num_free_blocks() == real_engine.pool.num_blocks


# --- chapter 11's swap_space, checked as asked (vLLM 0.10.2) before the pool is capped ---
def test_an_absurd_swap_space_is_refused_even_though_the_cap_would_hide_it():
    from minipaged.llm import LLM
    with pytest.raises(ValueError, match="Too large swap space: swap_space=1000000 GiB"):
        LLM(max_model_len=64, num_gpu_blocks_override=8, preemption_mode="swap",
            swap_space=10**6)


def test_swap_space_is_refused_above_70_and_warned_above_40_percent(monkeypatch):
    import minipaged.swap
    from minipaged.memory import GiB
    monkeypatch.setattr(minipaged.swap, "host_memory_bytes", lambda: 10 * GiB)
    with pytest.raises(ValueError, match="Too large swap space.*71%"):
        minipaged.swap.check_swap_space(7.1)
    with pytest.warns(UserWarning, match="Possibly too large swap space.*70%"):
        assert minipaged.swap.check_swap_space(7) == 7.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert minipaged.swap.check_swap_space(4) == 4.0


# --- what a wider sweep (every public name, one bad value at a time) found besides ---
@pytest.mark.parametrize(("field", "call"), [
    ("pool", lambda: OracleReservationManager(None)),
    ("pool", lambda: OracleReservationManager(64)),
    ("num_gpu_blocks", lambda: S.SimulatedEngine(10**30, 16, 256)),  # once a hang
    ("max_model_len", lambda: make_trace(3, 1.0, max_model_len=10**30)),
    ("num_requests", lambda: arrival_times(10**30, 1.0)),
    ("max_num_seqs", lambda: ReservingScheduler(OracleReservationManager(BlockPool(8, 4)),
                                                max_num_seqs=0)),
    ("max_num_batched_tokens", lambda: ReservingScheduler(
        OracleReservationManager(BlockPool(8, 4)), max_num_batched_tokens="many")),
    ("clock", lambda: serve(engine(), small_trace(), clock=lambda: None)),
    ("clock", lambda: serve(engine(), small_trace(), clock=lambda: NAN)),
    ("events", lambda: StepRecorder(BlockPool(4, 4), {}).read(None)),
    ("before", lambda: StepRecorder(BlockPool(4, 4), {}).tables_say(None, one_state())),
    ("after", lambda: StepRecorder(BlockPool(4, 4), {}).tables_say(one_state(), "state")),
    (r"StepState.tables must be a dict", lambda: one_state(tables=None)),
    (r"trace\[0\]", lambda: show_steps([1])),
    ("trace", lambda: show_steps("ab")),
    ("before", lambda: EngineRecorder_changes([1])),
    ("before", lambda: EngineRecorder_changes({})),
])
def test_the_sweep_s_findings_are_refused_by_name(field, call):
    with pytest.raises(ValueError, match=field):
        call()


def EngineRecorder_changes(before):
    model = random_model(ModelConfig.small(num_layers=1), seed=0, dtype=torch.float32,
                         device="cpu")
    return EngineRecorder(LLMEngine(model, 64, 16, 256)).changes(before)


def test_a_pool_block_costs_the_host_no_more_than_the_simulated_engine_counts():
    import tracemalloc
    tracemalloc.start()
    BlockPool(20_000, 16)
    used = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert used / 20_000 <= S.POOL_BYTES_PER_BLOCK
