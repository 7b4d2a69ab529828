"""The step player's recorder against the engine's own state, and the page it writes.

A step the player shows must be the state the engine had: each recorded step is checked
against the engine read directly at that moment, and against the pool's invariants; a run
with a recorder gives the same tokens and counters as one without.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from minipaged.blocks import BlockPool, BlockTable
from minipaged.engine import LLMEngine
from minipaged.engine_player import EngineRecorder
from minipaged.model import ModelConfig, random_model
from minipaged.player import (
    CELL,
    MAX_DELAY_MS,
    PALETTE,
    StepPlayer,
    StepRecorder,
    StepState,
    _draw_state,
    _request_colours,
    show_steps,
)
from minipaged.sampling import SamplingParams
from minipaged.scheduler import Request


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


def simple_trace():
    """Two tables taking blocks of a pool with no prefix cache: nothing cached, nothing shared."""
    pool, tables = BlockPool(num_blocks=4, block_size=4), {}
    recorder = StepRecorder(pool, tables)
    recorder.record()
    for name in "AB":
        tables[name] = BlockTable(pool)
        tables[name].ensure_capacity(4)
        recorder.record()
    return recorder.trace


def test_two_players_on_one_page_have_their_own_hatch():
    """Each player defines its own pattern and its pictures use that one, not another's."""
    pages = [show_steps(simple_trace())._repr_html_() for _ in range(2)]
    ids = [re.findall(r'<pattern id="([^"]+)"', page) for page in pages]
    assert all(len(found) == 1 for found in ids) and ids[0] != ids[1]
    for page, (pattern,) in zip(pages, ids):
        assert set(re.findall(r"url\(#([^)]+)\)", page)) <= {pattern}
        assert "mp-hatch" not in page


def test_the_legend_names_only_the_kinds_the_player_shows():
    page = show_steps(simple_trace())._repr_html_()
    assert "held (colour: the request)" in page and ">free<" in page
    assert "free, still cached" not in page and "held by more than one table" not in page


def test_the_player_takes_the_focus_and_keeps_a_legible_picture_on_a_narrow_screen():
    """A click on the picture focuses the figure (tabindex), whose keydown handler moves the
    steps; the picture keeps at least 600 px and its frame scrolls sideways below that."""
    page = show_steps(simple_trace())._repr_html_()
    assert re.search(r'<figure class="mp-player" id="[^"]+" tabindex="0"', page)
    assert 'root.addEventListener("keydown"' in page
    assert "min-width: 600px" in page and ".mp-frame { overflow-x: auto; }" in page


# --- bad input (issue 46): every public name checks its arguments; the rest is private ---
def test_the_players_public_names_are_the_ones_a_chapter_calls():
    """The drawing helpers and checks are private: a player checks its trace once, before
    they run, so a public name never draws a value it was not given whole."""
    from minipaged import engine_player, player
    public = {module.__name__: {name for name, value in vars(module).items()
                                if callable(value) and not name.startswith("_")
                                and getattr(value, "__module__", None) == module.__name__}
              for module in (player, engine_player)}
    assert public == {"minipaged.player": {"StepState", "StepRecorder", "StepPlayer", "show_steps"},
                      "minipaged.engine_player": {"EngineRecorder"}}
    assert not hasattr(StepPlayer, "frame")


def one_table_state() -> StepState:
    """A pool of 8 blocks in which table 'a' holds blocks 0 and 1; the rest are free."""
    pool, tables = BlockPool(num_blocks=8, block_size=4), {}
    tables["a"] = BlockTable(pool)
    tables["a"].ensure_capacity(8)
    return StepRecorder(pool, tables).record()


@pytest.mark.parametrize(("field", "fields"), [
    ("step", dict(step="x")), ("step", dict(step=-1)), ("step", dict(step=True)),
    ("events", dict(events=None)), ("events", dict(events=(5,))), ("events", dict(events=["a"])),
    ("ref_cnts", dict(ref_cnts=None)), ("ref_cnts", dict(ref_cnts=("x",) * 8)),
    ("ref_cnts", dict(ref_cnts=(-1,) * 8)), ("ref_cnts", dict(ref_cnts=(1.0,) * 8)),
    ("cached", dict(cached=())), ("cached", dict(cached=(None,) * 8)),
    ("cached", dict(cached=(0,) * 8)),
    ("free_queue", dict(free_queue=None)), ("free_queue", dict(free_queue=(True,))),
    ("free_queue", dict(free_queue=(2.0,))), ("free_queue", dict(free_queue=(99,))),
    ("free_queue", dict(free_queue=(-1,))), ("free_queue", dict(free_queue=(3, 3))),
    (r"free_queue holds block 0, whose ref_cnt is 1", dict(free_queue=(0,))),
    ("tables", dict(tables=None)), ("tables", dict(tables={5: (0,)})),
    (r"tables\['a'\]", dict(tables={"a": None})), (r"tables\['a'\]", dict(tables={"a": (99,)})),
    (r"tables\['a'\] holds block 0 twice", dict(tables={"a": (0, 0)})),
    (r"tables: block 5 is in 1 table, but its ref_cnt is 0", dict(tables={"a": (5,)})),
    (r"tables: block 0 is in 2 tables", dict(tables={"a": (0, 1), "b": (0,)})),
    ("queues", dict(queues=None)), (r"queues\['w'\]", dict(queues={"w": None})),
    (r"queues\['w'\]", dict(queues={"w": (1,)})), ("queues", dict(queues={5: ("a",)})),
    ("more_tables", dict(more_tables=None)),
    (r"more_tables\['h'\]", dict(more_tables={"h": None})),
    (r"more_tables\['h'\]\['a'\] holds block -1", dict(more_tables={"h": {"a": (-1,)}})),
    (r"more_tables\['h'\]\['a'\] holds block 1 twice", dict(more_tables={"h": {"a": (1, 1)}})),
])
def test_a_state_no_pool_could_have_left_is_refused_by_its_field(field, fields):
    with pytest.raises(ValueError, match=rf"StepState\.{field}"):
        dataclasses.replace(one_table_state(), **fields)


def test_a_state_of_numpy_counts_is_a_state_and_a_player_opens_at_a_numpy_step():
    state = StepState(np.int64(0), (), (np.int64(1),) + (0,) * 7, (np.bool_(False),) * 8,
                      (np.int64(1), 2), {"a": (np.int64(0),)})
    page = show_steps([state, one_table_state()], start=np.int64(1))._repr_html_()
    assert "show(1)" in page and page.count('<div class="mp-frame"') == 2
    with pytest.raises(ValueError, match="start"):
        show_steps([state], start=np.bool_(False))


def test_more_tables_are_another_pools_so_their_ids_may_pass_the_device_pool():
    state = dataclasses.replace(one_table_state(), more_tables={"host": {"a": (99,)}})
    assert ">99</text>" in show_steps([state])._repr_html_()


@pytest.mark.parametrize(("field", "change"), [
    (r"trace\[0\]\.tables\['a'\]", lambda s: s.tables.__setitem__("a", None)),
    (r"trace\[0\]\.tables\['a'\] holds block 99", lambda s: s.tables.__setitem__("a", (99,))),
    (r"trace\[0\]\.queues\['w'\]", lambda s: s.queues.__setitem__("w", (1,))),
    (r"trace\[0\]\.more_tables\['h'\]", lambda s: s.more_tables.__setitem__("h", None)),
    (r"trace\[0\]\.more_tables names 'zz'",
     lambda s: s.more_tables.__setitem__("h", {"zz": (1,)})),
])
def test_a_player_reads_each_step_again_as_it_is_made_and_as_it_is_shown(field, change):
    """A state is frozen, its dicts are not: one changed in place is refused by the player made
    after, and by a player made before, when it is shown."""
    early = one_table_state()
    player = show_steps([early])
    change(early)
    with pytest.raises(ValueError, match=field):
        player._repr_html_()
    late = one_table_state()
    change(late)
    with pytest.raises(ValueError, match=field):
        show_steps([late])


def test_a_player_whose_fields_were_changed_refuses_to_show():
    player = show_steps([one_table_state()])
    player.trace.append(None)
    with pytest.raises(ValueError, match=r"trace\[1\] must be a StepState"):
        player._repr_html_()
    player = StepPlayer([one_table_state()])
    player.delay_ms = 10**30
    with pytest.raises(ValueError, match="delay_ms"):
        player._repr_html_()


@pytest.mark.parametrize("delay_ms", [0, -1, 1.5, True, None, "700", 60_001, 2**31, 10**30])
def test_a_delay_that_is_not_whole_milliseconds_up_to_a_minute_is_refused(delay_ms):
    with pytest.raises(ValueError, match="delay_ms"):
        StepPlayer([one_table_state()], delay_ms=delay_ms)


def test_a_delay_of_a_minute_reaches_the_script():
    page = StepPlayer([one_table_state()], delay_ms=np.int64(MAX_DELAY_MS))._repr_html_()
    assert f"\n                        {MAX_DELAY_MS});" in page


@pytest.mark.parametrize(("field", "tables"), [
    ("request ids", lambda pool: {5: BlockTable(pool)}),
    (r"block_tables\['a'\] is a table of another pool",
     lambda pool: {"a": BlockTable(BlockPool(num_blocks=pool.num_blocks, block_size=4))}),
    (r"block_tables\['a'\] must be a BlockTable", lambda pool: {"a": [0, 1]}),
])
def test_a_recorder_refuses_a_table_it_could_not_read_when_made_and_when_it_joins(field, tables):
    pool = BlockPool(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=field):
        StepRecorder(pool, tables(pool))
    live = {}
    recorder = StepRecorder(pool, live)
    live.update(tables(pool))
    with pytest.raises(ValueError, match=field):
        recorder.record("x")
    assert recorder.trace == []


@pytest.mark.parametrize(("field", "before", "after"), [
    ("before must be a StepState", None, "state"),
    ("after must be a StepState", "state", "dict"),
    (r"before\.tables\['a'\]", "mutated", "state"),
])
def test_tables_say_refuses_what_is_not_a_state(field, before, after):
    recorder, mutated = StepRecorder(BlockPool(num_blocks=8, block_size=4), {}), one_table_state()
    mutated.tables["a"] = "ab"
    pick = {"state": one_table_state(), "mutated": mutated, "dict": {}, None: None}
    with pytest.raises(ValueError, match=field):
        recorder.tables_say(pick[before], pick[after])


BAD_BEFORE = [  # what a step's changes are measured from, given wrong: (field, build)
    ("before must be what read_before", lambda r, s: None),
    ("before must be what read_before", lambda r, s: {"requests": [r]}),
    ("keyed by Request", lambda r, s: {"requests": {"A": (s, 0, 0)}}),
    (r"\['A'\] must be \(status", lambda r, s: {"requests": {r: ("x", "y", "z")}}),
    (r"\['A'\] must be \(status", lambda r, s: {"requests": {r: (None, None, None)}}),
    (r"\['A'\] must be \(status", lambda r, s: {"requests": {r: [s, 0, 0]}}),
    (r"\['A'\]'s computed tokens must be an integer", lambda r, s: {"requests": {r: (s, 0.5, 0)}}),
    (r"\['A'\]'s computed tokens must be an integer", lambda r, s: {"requests": {r: (s, -5, 0)}}),
    (r"\['A'\]'s computed tokens must be at most", lambda r, s: {"requests": {r: (s, 10**30, 0)}}),
    (r"\['A'\]'s preemptions must be an integer", lambda r, s: {"requests": {r: (s, 0, -1)}}),
    (r"\['A'\]'s preemptions must be at most 0", lambda r, s: {"requests": {r: (s, 0, 1)}}),
    ("a request this engine does not hold",
     lambda r, s: {"requests": {Request("A", [1, 2], SamplingParams()): (s, 0, 0)}}),
]


@pytest.mark.parametrize(("field", "build"), BAD_BEFORE)
def test_changes_refuses_counts_no_request_of_the_engine_had(model, field, build):
    """EngineRecorder.changes, the method later chapters extend, checks its before; the run
    then goes on to the end, recorded as it would have been."""
    engine = starved_engine(model)
    recorder = EngineRecorder(engine)
    recorder.record("before")
    recorder.step()
    request = engine.requests["A"]
    with pytest.raises(ValueError, match=field):
        recorder.changes(build(request, request.status))
    assert len(recorder.trace) == 2
    recorder.run()
    assert not engine.has_unfinished_requests()
    assert [s.step for s in recorder.trace] == list(range(engine.num_steps + 1))


def test_changes_reads_numpy_counts_as_counts(model):
    engine = starved_engine(model)
    recorder = EngineRecorder(engine)
    before = recorder.read_before()
    engine.step()
    as_numpy = {"requests": {r: (s, np.int64(c), np.int64(p))
                             for r, (s, c, p) in before["requests"].items()}}
    assert recorder.changes(as_numpy) == recorder.changes(before) != []
