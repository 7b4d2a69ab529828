"""The step player's recorder against the engine's own state, and the page it writes.

A step the player shows must be the state the engine had: each recorded step is checked
against the engine read directly at that moment, and against the pool's invariants; a run
with a recorder gives the same tokens and counters as one without.
"""
from __future__ import annotations

import re

import pytest

from minipaged.blocks import BlockPool, BlockTable
from minipaged.engine import LLMEngine
from minipaged.engine_player import EngineRecorder
from minipaged.model import ModelConfig, random_model
from minipaged.player import CELL, PALETTE, StepRecorder, _draw_state, _request_colours, show_steps
from minipaged.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.small(num_layers=1), seed=0)


def starved_engine(model) -> LLMEngine:
    """Three requests that do not fit together in eight blocks of four: a preemption."""
    engine = LLMEngine(model, num_gpu_blocks=8, block_size=4, max_model_len=32,
                       max_num_batched_tokens=8)
    for name in "ABC":
        engine.add_request(name, list(range(1, 11)), SamplingParams(temperature=0, max_tokens=8))
    return engine


def engine_state(engine: LLMEngine) -> dict:
    """What the engine holds, read without the recorder."""
    manager, scheduler = engine.scheduler.kv_cache_manager, engine.scheduler
    return dict(ref_cnts=tuple(b.ref_cnt for b in engine.pool.blocks),
                free_queue=tuple(b.block_id for b in engine.pool.free_block_queue),
                tables={rid: tuple(t.block_ids) for rid, t in manager.block_tables.items()},
                queues={"running": tuple(r.request_id for r in scheduler.running),
                        "waiting": tuple(r.request_id for r in scheduler.waiting)})


@pytest.fixture(scope="module")
def recorded(model):
    """A starved run driven by a recorder, with the engine's own state read after each step,
    and the tokens each request got."""
    engine = starved_engine(model)
    recorder = EngineRecorder(engine)
    recorder.record("before")
    states, tokens = [engine_state(engine)], {}
    while engine.has_unfinished_requests():
        for request in recorder.step():
            tokens.setdefault(request.request_id, []).append(request.output_token_ids[-1])
        states.append(engine_state(engine))
    return engine, recorder.trace, states, tokens


def test_each_recorded_step_is_the_engines_state(recorded):
    engine, trace, states, _ = recorded
    assert len(trace) == len(states) == engine.num_steps + 1
    for state, now in zip(trace, states):
        assert {k: getattr(state, k) for k in now} == now
        held = [sum(b in blocks for blocks in state.tables.values())
                for b in range(engine.pool.num_blocks)]
        assert list(state.ref_cnts) == held  # no prefix cache: a count is its tables
        assert sorted(state.free_queue) == [b for b, n in enumerate(held) if n == 0]


def test_a_recorder_changes_nothing_in_the_run(model, recorded):
    watched, _, _, recorded_tokens = recorded
    plain, tokens = starved_engine(model), {}
    while plain.has_unfinished_requests():
        for request in plain.step():
            tokens.setdefault(request.request_id, []).append(request.output_token_ids[-1])
    assert recorded_tokens == tokens and watched.stats() == plain.stats()


def test_the_trace_says_when_a_request_is_preempted(recorded):
    engine, trace, _, _ = recorded
    assert engine.stats()["num_preemptions"] > 0
    said = [(s.step, e.split(" is preempted")[0]) for s in trace for e in s.events
            if " is preempted" in e]
    assert len(said) == engine.stats()["num_preemptions"]
    for step, victim in said:  # the victim's blocks went back in that very step
        before, after = trace[step - 1], trace[step]
        assert victim in before.tables and victim not in after.tables
        assert after.queues["waiting"][0] == victim  # it waits at the front


def test_each_picture_draws_the_engines_state(recorded):
    """The pool grid of every step's picture: each block in the colour of the request whose
    table (read from the engine at that step) holds it, or free; shared ones outlined."""
    engine, trace, states, _ = recorded
    colours = _request_colours(trace)
    for state, now in zip(trace, states):
        cells = re.findall(rf'<rect [^>]*width="{CELL}" [^>]*fill="([^"]+)" stroke="([^"]+)"',
                           _draw_state(state, colours))
        assert len(cells) == engine.pool.num_blocks
        for block_id, (fill, stroke) in enumerate(cells):
            holders = [rid for rid, blocks in now["tables"].items() if block_id in blocks]
            assert fill == (PALETTE[colours[holders[0]]] if holders else "#f2f2f2")
            assert (stroke == "#000") == (len(holders) > 1)


def test_tables_growing_and_given_back_are_said():
    pool, tables = BlockPool(num_blocks=6, block_size=4), {}
    recorder = StepRecorder(pool, tables)
    recorder.record()
    tables["A"] = BlockTable(pool)
    tables["A"].ensure_capacity(6)
    assert recorder.record().events == ("A takes blocks 0, 1",)
    tables.pop("A").free()
    state = recorder.record()
    assert state.events == ("A gives back 0, 1",) and state.free_queue == (2, 3, 4, 5, 1, 0)


def test_the_page_shows_one_step_without_scripts():
    pool, tables = BlockPool(num_blocks=4, block_size=4), {}
    recorder = StepRecorder(pool, tables)
    for n in range(3):
        tables[f"r{n}"] = BlockTable(pool)
        tables[f"r{n}"].ensure_capacity(4)
        recorder.record()
    page = show_steps(recorder.trace, start=1)._repr_html_()
    frames = re.findall(r'<div class="mp-frame"[^>]*>', page)
    assert len(frames) == 3 and [" hidden" in f for f in frames] == [True, False, True]
    assert '<div class="mp-controls" hidden>' in page  # shown by the script only
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # nothing fetched


@pytest.mark.parametrize("start", [-1, 3, 1.0])
def test_a_start_outside_the_trace_is_refused(start):
    pool = BlockPool(num_blocks=2, block_size=4)
    recorder = StepRecorder(pool, {})
    for _ in range(3):
        recorder.record()
    with pytest.raises(ValueError, match="start"):
        show_steps(recorder.trace, start=start)
