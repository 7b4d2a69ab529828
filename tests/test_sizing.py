"""Chapter 7's sizing, where a GPU differs from a CPU: the profile of a full step (every
sequence's logits row), and the release of GPU and pinned host memory. The CUDA calls are
stand-ins here, recording what is called, in which order, with which torch's names."""
import re
from pathlib import Path

import pytest
import torch

import minipaged.sizing
from minipaged.checks import cdiv
from minipaged.model import ModelConfig, random_model
from minipaged.sizing import (
    empty_host_cache,
    pinned_host_bytes,
    profile_batch,
    profiled_activation_bytes,
    release_memory,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("tokens,seqs,block_size", [(2048, 256, 16), (2048, 1, 16), (100, 256, 16),
                                                    (513, 7, 4), (5, 5, 16)])
def test_the_profiled_step_is_the_fullest_step_the_engine_schedules(tokens, seqs, block_size):
    tables, lengths = profile_batch(tokens, seqs, block_size)
    assert len(lengths) == min(seqs, tokens) and sum(lengths) == tokens  # one row per sequence
    assert max(lengths) - min(lengths) <= tokens % len(lengths)  # shared as evenly as they go
    blocks = [b for table in tables for b in table]
    assert sorted(blocks) == list(range(len(blocks)))  # blocks of its own for every sequence
    assert all(len(t) == cdiv(n, block_size) for t, n in zip(tables, lengths))


def test_the_profile_counts_a_logits_row_for_every_sequence():
    """A full step holds max_num_seqs rows of logits and the engine's copy of the sampled rows:
    the profile's peak covers them, where a profile of one sequence holds one row."""
    config = ModelConfig.small(num_layers=1, vocab_size=32_768)
    model = random_model(config, seed=0)  # fp32 on a CPU: 4 bytes a logit
    rows, tokens = 64, 128
    full = profiled_activation_bytes(model, 16, tokens, max_num_seqs=rows)
    one = profiled_activation_bytes(model, 16, tokens, max_num_seqs=1)
    logits_and_copy = rows * config.vocab_size * 4 * 2
    assert full >= logits_and_copy > one  # one sequence's profile misses the other rows


def test_determine_num_gpu_blocks_profiles_with_max_num_seqs(monkeypatch):
    seen = []
    monkeypatch.setattr(minipaged.sizing, "device_memory", lambda device: (8 * 2**30, 16 * 2**30))
    monkeypatch.setattr(minipaged.sizing, "profiled_activation_bytes",
                        lambda model, block_size, tokens, seqs: seen.append((tokens, seqs)) or 0)
    model = random_model(ModelConfig.small(num_layers=1), seed=0)
    minipaged.sizing.determine_num_gpu_blocks(model, 16, 0.9, 2048, max_num_seqs=96)
    assert seen == [(2048, 96)]


@pytest.fixture
def pretend_cuda(monkeypatch):
    """torch.cuda as a GPU machine's: the calls release_memory may make, recorded in order."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("_host_emptyCache"),
                        raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_emptyHostCache",
                        lambda: calls.append("_accelerator_emptyHostCache"), raising=False)
    monkeypatch.setattr(minipaged.sizing.gc, "collect", lambda: calls.append("gc") or 0)
    return calls


def test_release_hands_back_gpu_blocks_then_pinned_host_blocks(pretend_cuda, monkeypatch):
    release_memory()
    assert pretend_cuda == ["gc", "synchronize", "empty_cache", "_host_emptyCache"]
    pretend_cuda.clear()
    monkeypatch.delattr(torch._C, "_host_emptyCache")  # a torch without the CUDA binding
    release_memory()
    assert pretend_cuda == ["gc", "synchronize", "empty_cache", "_accelerator_emptyHostCache"]
    pretend_cuda.clear()
    monkeypatch.delattr(torch._C, "_accelerator_emptyHostCache")  # neither: nothing to call
    empty_host_cache()
    assert pretend_cuda == []


def test_without_cuda_release_only_collects_and_nothing_is_pinned(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("host"),
                        raising=False)
    release_memory()
    assert calls == [] and pinned_host_bytes() == 0


def test_pinned_bytes_are_read_under_either_torchs_names(pretend_cuda, monkeypatch):
    def stats(found):
        monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: found, raising=False)
        return pinned_host_bytes()

    # an older layout: blocks held in reserved_bytes, those handed out in allocated_bytes
    assert stats({"reserved_bytes.current": 3 * 2**20, "allocated_bytes.current": 2**20}) \
        == 3 * 2**20
    # torch 2.13's: allocated_bytes counts held blocks, in use and cached (active_bytes: in use)
    assert stats({"allocated_bytes.current": 5 * 2**20, "active_bytes.current": 0}) == 5 * 2**20
    assert stats({}) is None
    monkeypatch.delattr(torch.cuda, "host_memory_stats")
    assert pinned_host_bytes() is None


@pytest.mark.parametrize("chapter", ["07_under_load", "08_prefix_caching", "10_sharing",
                                     "11_swap"])
def test_the_chapters_release_pinned_memory_with_the_gpus(chapter):
    """No chapter that builds engine after engine empties only the GPU's cache."""
    source = (ROOT / "chapters" / f"{chapter}.md").read_text()
    assert "release_memory()" in source
    assert not re.search(r"torch\.cuda\.empty_cache\(\)", source)
