"""Every chapter at full size fits a T4: the ledger of tools/t4_ledger.py, on every chapter.

The ledger walks each chapter's cells at full size (``runtime.pick(full=...)``, the real
Qwen2.5-0.5B in fp16, its configuration read from chapter 6) and adds up what is alive on the
device at every allocation: weights, KV caches sized by the engine's own ``num_cache_blocks``,
the CUDA context and one step's activation peak. The first test is the guarantee; the others
show that the ledger sees what it must (an unsized engine, two engines alive at once, a
construction it never reached), on small notebooks written for the purpose.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb"))


pytestmark = pytest.mark.heavy  # the ledger walks every chapter: seconds, left to make test

@pytest.fixture(scope="module")
def t4_ledger():
    from bench.t4_estimate import load_ledger  # the one loader of tools/t4_ledger.py

    return load_ledger()


@pytest.fixture(scope="module")
def chapter_ledgers(t4_ledger):
    return {}


def ledger_of(t4_ledger, chapter_ledgers, notebook: Path):
    """The chapter's ledger, computed once for the module."""
    if notebook.stem not in chapter_ledgers:
        chapter_ledgers[notebook.stem] = t4_ledger.ledger(notebook)
    return chapter_ledgers[notebook.stem]


@pytest.mark.parametrize("notebook", CHAPTERS, ids=[n.stem for n in CHAPTERS])
def test_every_chapter_fits_a_t4_at_full_size(t4_ledger, chapter_ledgers, notebook):
    from minipaged.memory import T4_TOTAL_BYTES

    result = ledger_of(t4_ledger, chapter_ledgers, notebook)
    assert not result.over, f"more than a T4 holds alive at once: {result.over}"
    assert not result.refused, f"engines a T4 would refuse: {result.refused}"
    assert not result.unsized, f"engines on the GPU without an explicit size: {result.unsized}"
    assert not result.unreached, f"engine constructions the ledger never reached: " \
                                 f"{result.unreached}"
    assert result.peak is None or result.peak.total <= T4_TOTAL_BYTES


def test_the_chapters_that_serve_the_real_model_are_seen_doing_so(t4_ledger, chapter_ledgers):
    """The ledger is no vacuous pass: it books the real weights and real engines."""
    from minipaged.memory import QWEN2_5_0_5B

    results = {n.stem[:2]: ledger_of(t4_ledger, chapter_ledgers, n) for n in CHAPTERS}
    for chapter in ["07", "08", "09", "10", "11"]:
        events = results[chapter].events
        assert any(e.what.startswith("load_model") for e in events), chapter
        assert any(e.what.startswith(("LLM: ", "LLMFrontEnd: ")) for e in events), chapter
        assert results[chapter].peak.activation > 0
    assert t4_ledger.model_bytes(t4_ledger.qwen_config(), 2) == QWEN2_5_0_5B.weight_bytes


def notebook(tmp_path: Path, *cells: str) -> Path:
    """An .ipynb of these code cells, after chapter 1's first cell and a loaded model."""
    setup = ["from minipaged.runtime import Runtime\nruntime = Runtime.detect()",
             "from minipaged import LLM\nfrom minipaged.huggingface import load_model\n"
             "model = load_model('Qwen/Qwen2.5-0.5B-Instruct', dtype=runtime.dtype, "
             "device=runtime.device)"]
    path = tmp_path / "99_test.ipynb"
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": source}
                                          for source in setup + list(cells)]}))
    return path


def test_an_engine_left_at_the_default_utilization_is_named(t4_ledger, tmp_path):
    result = t4_ledger.ledger(notebook(tmp_path, "llm = LLM(model=model, max_model_len=2048)"))
    assert result.unsized == ["line 1: LLM"] and not result.over
    sized = t4_ledger.ledger(notebook(
        tmp_path, "llm = LLM(model=model, max_model_len=2048, gpu_memory_utilization=0.5)"))
    assert not sized.unsized


def test_two_engines_alive_at_once_overflow_and_released_in_between_fit(t4_ledger, tmp_path):
    from minipaged.memory import GiB

    big = "LLM(model=model, max_model_len=2048, num_gpu_blocks_override=runtime.pick(" \
          "small=128, full=40_000))"  # 7.3 GiB of cache at full size
    both = t4_ledger.ledger(notebook(tmp_path, f"a = {big}", f"b = {big}"))
    assert both.over and both.peak.total > 14.5 * GiB
    released = t4_ledger.ledger(notebook(tmp_path, f"a = {big}", f"del a\nb = {big}"))
    assert not released.over and released.peak.total < 9 * GiB
    # Rebinding in a loop: the old engine lives until the new one is built, as in Python.
    looped = t4_ledger.ledger(notebook(tmp_path, f"for _ in range(3):\n    llm = {big}"))
    assert looped.over
    in_a_function = t4_ledger.ledger(notebook(
        tmp_path, f"def fresh():\n    llm = {big}\n    return 1",
        "x = [fresh() for _ in range(3)]"))
    assert not in_a_function.over


def test_an_engine_the_card_cannot_size_is_refused_and_an_unreached_one_named(t4_ledger,
                                                                             tmp_path):
    full_card = "a = LLM(model=model, max_model_len=2048, gpu_memory_utilization=0.9)"
    refused = t4_ledger.ledger(notebook(
        tmp_path, full_card, "b = LLM(model=model, max_model_len=2048, "
                             "gpu_memory_utilization=0.9)"))
    assert any("No available memory for the cache blocks" in r for r in refused.refused)
    unreached = t4_ledger.ledger(notebook(
        tmp_path, "def never():\n    return LLM(model=model, num_gpu_blocks_override=200)"))
    assert unreached.unreached == ["cell 2 line 2"]


def test_a_starved_pool_counts_the_steps_preemption_adds(t4_ledger, tmp_path):
    """Chapter 7's starved run at full size: 200 requests of 9 + 1,000 tokens on a pool 2.65
    times too small take far more than the 1,000 steps of an ample pool, as the scheduler runs."""
    prompts = "prompts = [{'prompt_token_ids': [1] * 9} for _ in range(200)]"
    params = "params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)"
    starved = "llm = LLM(model=model, max_model_len=1024, num_gpu_blocks_override=4832)"
    ample = "llm = LLM(model=model, max_model_len=1024, num_gpu_blocks_override=12800)"
    runs = {name: t4_ledger.ledger(notebook(tmp_path, prompts, params, pool,
                                            "llm.generate(prompts, params)")).work
            for name, pool in [("starved", starved), ("ample", ample)]}
    assert runs["ample"].preemption_steps == 0 and runs["ample"].steps == 1001
    steps, computed, preemptions = t4_ledger.scheduled_work([(9, 1000)] * 200, 4832, 16, 1024,
                                                            256, 2048)
    assert preemptions > 0 and steps > 1.5 * 1000
    assert runs["starved"].steps == steps  # all 200 requests, not the walker's first 64
    assert runs["starved"].preemption_steps == steps - 1001
    assert runs["starved"].recomputed_tokens == computed - 200 * (9 + 1000 - 1) > 0


# --- the host's side: a Colab VM, swap pools and pinned memory ---------------------------------


def test_chapter_11_pins_only_its_staging_and_nothing_after_release(t4_ledger, chapter_ledgers):
    """Chapter 11 at full size: the host pools are pageable and sized to the workloads; the
    only pinned memory is the staging pair, at most two powers of two as large as one layer of
    vLLM's default 4 GiB pool; every release() leaves nothing pinned; the VM holds it all."""
    from minipaged.memory import QWEN2_5_0_5B, GiB
    from minipaged.swap import pinned_bytes

    notebook = next(n for n in CHAPTERS if n.stem == "11_swap")
    result = ledger_of(t4_ledger, chapter_ledgers, notebook)
    staging_bound = 2 * pinned_bytes(4 * GiB // QWEN2_5_0_5B.num_layers)
    assert 0 < result.pinned_peak <= staging_bound
    assert result.host_peak <= 4 * GiB + result.pinned_peak  # at most swap_space, plus staging
    assert result.host_peak <= t4_ledger.COLAB_HOST_BYTES / 2  # half the VM left to the process
    assert result.pinned_after_release and not any(result.pinned_after_release)
    assert not result.host_over


SWAP_ENGINE = ("LLM(model=model, max_model_len=4096, num_gpu_blocks_override=4832, "
               "preemption_mode='swap', swap_space={gib})")
WORK = ("prompts = [{'prompt_token_ids': [1] * 9} for _ in range(200)]\n"
        "params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)")


def test_two_swap_engines_in_a_row_fit_the_vm_when_release_empties_the_pinned_cache(t4_ledger,
                                                                                     tmp_path):
    from minipaged.memory import QWEN2_5_0_5B, GiB
    from minipaged.swap import pinned_bytes

    engine = SWAP_ENGINE.format(gib=4)
    pool = 4 * GiB // (16 * QWEN2_5_0_5B.kv_bytes_per_token) * 16 * QWEN2_5_0_5B.kv_bytes_per_token
    staging = 2 * pinned_bytes(pool // QWEN2_5_0_5B.num_layers)
    run = f"llm = {engine}\nllm.generate(prompts, params)\ndel llm"
    released = t4_ledger.ledger(notebook(tmp_path, WORK, "from minipaged.sizing import "
                                         "release_memory", run, "release_memory()", run,
                                         "release_memory()"))
    assert released.pinned_peak == staging and released.host_peak == pool + staging
    assert released.pinned_after_release == [0, 0] and not released.host_over
    kept = t4_ledger.ledger(notebook(tmp_path, WORK, run, run))  # torch's cache keeps the first
    assert kept.pinned_peak == 2 * staging and kept.host_peak == pool + 2 * staging
    too_large = t4_ledger.ledger(notebook(tmp_path, WORK, f"llm = {SWAP_ENGINE.format(gib=13)}"))
    assert too_large.host_over  # a pool larger than the VM: the scheduler's check refuses it
