"""vLLM's own block pool and KV-cache manager, loaded on a CPU from one release's sources.

``tools/vllm_check.py`` unpacks the release's ``vllm/**/*.py`` into a cache; this module imports
the files under test from there as they are: ``vllm/v1/core/kv_cache_utils.py``,
``block_pool.py``, ``single_type_kv_cache_manager.py``, ``kv_cache_coordinator.py``,
``kv_cache_manager.py``, ``kv_cache_metrics.py``, ``vllm/v1/request.py``,
``vllm/v1/kv_cache_interface.py``, ``vllm/v1/metrics/stats.py`` and the small helpers they
need (``REAL``). Every other ``vllm`` module they import is replaced by a stub that
``STUBS`` lists, each with why it is stubbed: a module that cannot load here (it needs CUDA, a
compiled extension or a package minipaged does not install) and whose code the differential
test does not exercise. No logic under test is stubbed, and an import of a ``vllm`` module in
neither list fails, naming it, so the two lists are the whole story.

The release is imported under its own name, ``vllm``, into ``sys.modules``; a second release
cannot be loaded into the same process (``make vllm-check`` runs one per process).
"""
from __future__ import annotations

import enum
import hashlib
import importlib
import importlib.abc
import importlib.util
import pickle
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Modules executed from the release's own files.
REAL = {
    "vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool",
    "vllm.v1.core.single_type_kv_cache_manager", "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_metrics", "vllm.v1.request",
    "vllm.v1.kv_cache_interface", "vllm.v1.kv_cache_spec_registry", "vllm.v1.kv_cache_layout",
    "vllm.v1.metrics.stats", "vllm.utils.math_utils",
    # newer releases (0.34.0) split these out of the files above
    "vllm.v1.token_buffer", "vllm.utils.collection_utils", "vllm.utils.gc_utils",
    "vllm.v1.metrics.cache_hit_source", "vllm.v1.hisparse.block_pool",
}


def _placeholder(name: str) -> type:
    """A class that stands for a type the code under test only names (annotations, isinstance
    checks on specs the test never builds)."""
    return type(name, (), {"__module__": "vllm_stub"})


class _Logger:
    def __getattr__(self, name: str):  # debug, info, warning, info_once, warning_once, ...
        return lambda *args, **kwargs: None


def _sha256(value: Any) -> bytes:
    """vLLM's default prefix-cache hash, ``vllm.utils.hashing.sha256``: SHA-256 of the
    highest-protocol pickle (the real module is stubbed only because it imports cbor2)."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash(value: Any) -> bytes:  # never called: the test hashes with sha256
    raise NotImplementedError("xxhash is not used by the differential test")


class _ConstantList(Sequence):
    """vllm.v1.utils.ConstantList: a read-only view of a list that its owner keeps growing."""

    def __init__(self, items: list) -> None:
        self._items = items

    def __getitem__(self, index):
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"ConstantList({self._items!r})"


class _EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


# module -> (why it is stubbed, the names it provides)
STUBS: dict[str, tuple[str, dict[str, Any]]] = {
    "vllm.envs": ("reads the environment for the whole engine; the code under test reads no "
                  "variable from it on these paths", {}),
    "vllm.logger": ("configures vLLM's logging (imports vllm.envs and logging_utils); log lines "
                    "change no state", {"init_logger": lambda name: _Logger()}),
    "vllm.config": ("the engine's configuration package imports transformers, pydantic and every "
                    "model's config; the code under test names VllmConfig only in annotations "
                    "and in the sizing functions the test does not call; with no engine "
                    "running there is no current config (the spec registry asks)",
                    {"VllmConfig": _placeholder("VllmConfig"),
                     "get_current_vllm_config_or_none": lambda: None}),
    "vllm.utils.hashing": ("imports cbor2, which minipaged does not install; sha256 is "
                           "reproduced exactly (pickle then SHA-256) and xxhash is unused",
                           {"sha256": _sha256, "xxhash": _xxhash, "xxhash_cbor": _xxhash,
                            "sha256_cbor": _xxhash}),
    "vllm.utils.mem_utils": ("CUDA memory profiling; only format_gib, for log lines",
                             {"format_gib": lambda b: f"{b / 2**30:.2f}"}),
    "vllm.utils.torch_utils": ("imports the platform layer (CUDA detection); only "
                               "get_dtype_size, for byte sizes the test does not use",
                               {"get_dtype_size": lambda dtype: dtype.itemsize}),
    "vllm.v1.utils": ("imports uvloop and the usage-stats client; Request wraps its token lists "
                      "in ConstantList, a read-only view (a view, not a copy: the lists grow), "
                      "given here as the same view; tensor_data is unused",
                      {"tensor_data": lambda t: t, "ConstantList": _ConstantList}),
    "vllm.distributed.kv_events": ("imports zmq and msgspec to publish KV-cache events; the "
                                   "test runs with events off (enable_kv_cache_events=False)",
                                   {name: _placeholder(name) for name in (
                                       "AllBlocksCleared", "BlockRemoved", "BlockStored",
                                       "KVCacheEvent")} | {"MEDIUM_GPU": "GPU",
                                                           "MEDIUM_CPU": "CPU"}),
    "vllm.v1.attention.backends.registry": ("the attention backends' registry imports the "
                                            "platform layer; kv_cache_interface names one enum "
                                            "of it for Mamba specs",
                                            {"MambaAttentionBackendEnum": enum.Enum(
                                                "MambaAttentionBackendEnum", "MAMBA2")}),
    "vllm.platforms": ("detects the device (CUDA, ROCm, TPU...) on import; the spec registry "
                       "asks it only for a platform's own KV-cache specs, of which a CPU "
                       "test has none", {"current_platform": types.SimpleNamespace(
                           register_custom_kv_cache_specs=lambda config: None)}),
    "vllm.multimodal.inputs": ("multimodal inputs (transformers, PIL); requests here carry "
                               "none", {"MultiModalFeatureSpec": _placeholder(
                                   "MultiModalFeatureSpec")}),
    "vllm.multimodal.utils": ("multimodal helpers (PIL, transformers); with no multimodal "
                              "features the window search is never called",
                              {"get_mm_features_in_window": lambda features, start, end: (0, 0)}),
    "vllm.v1.kv_hints": ("KV-transfer hints (0.34.0) for disaggregated serving; requests "
                         "here carry none", {"KvHintsEnvelope": _placeholder("KvHintsEnvelope")}),
    "vllm.pooling_params": ("pooling models; requests here sample",
                            {"PoolingParams": _placeholder("PoolingParams")}),
    "vllm.sampling_params": ("imports the tokenizer stack and msgspec; Request reads only the "
                             "fields the test's stand-in gives it", {
                                 "SamplingParams": _placeholder("SamplingParams")}),
    "vllm.utils": ("the package's __init__ imports the platform layer; one helper is used",
                   {"length_from_prompt_token_ids_or_embeds":
                    lambda ids, embeds: len(ids) if ids is not None else len(embeds)}),
    "vllm.v1.engine": ("the engine's wire types need msgspec; Request records events only when "
                       "asked to", {"EngineCoreEvent": _placeholder("EngineCoreEvent"),
                                    "EngineCoreEventType": _EngineCoreEventType,
                                    "EngineCoreRequest": _placeholder("EngineCoreRequest"),
                                    "FinishReason": enum.IntEnum(
                                        "FinishReason", "STOP LENGTH ABORT ERROR REPETITION")}),
    "vllm.v1.structured_output.request": ("grammars (xgrammar); requests here have none",
                                          {"StructuredOutputRequest": type(
                                              "StructuredOutputRequest", (), {
                                                  "from_sampling_params": staticmethod(
                                                      lambda params: None)})}),
    "vllm.compilation.cuda_graph": ("CUDA graphs; stats.py names a stat type of it",
                                    {"CUDAGraphStat": _placeholder("CUDAGraphStat")}),
    "vllm.v1.metrics.perf": ("performance counters (imports the model config); stats.py names "
                             "a type", {"PerfStats": _placeholder("PerfStats")}),
    "vllm.v1.spec_decode.metrics": ("speculative decoding; stats.py names a type",
                                    {"SpecDecodingStats": _placeholder("SpecDecodingStats")}),
}


class _ReleaseFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        rel = self.root / Path(*name.split("."))
        if name in STUBS:
            return importlib.util.spec_from_loader(name, self, is_package=rel.is_dir())
        if name in REAL:
            return importlib.util.spec_from_file_location(name, rel.with_suffix(".py"))
        if rel.is_dir():  # a package: its __init__ is not run (it imports the engine)
            spec = importlib.util.spec_from_loader(name, self, is_package=True)
            spec.submodule_search_locations = [str(rel)]
            return spec
        raise ImportError(f"{name} is neither loaded from the release (REAL) nor stubbed "
                          "(STUBS) in tests/vllm_release.py")

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ in STUBS:
            module.__dict__.update(STUBS[module.__name__][1])
            module.__stub_reason__ = STUBS[module.__name__][0]


def load(root: Path) -> types.SimpleNamespace:
    """Import the release under ``root`` (the directory holding ``vllm/``) and return its
    modules under test."""
    if "vllm" in sys.modules and getattr(sys.modules["vllm"], "__release_root__", None) != root:
        if getattr(sys.modules["vllm"], "__release_root__", None) is not None:
            raise RuntimeError("another vLLM release is already loaded in this process")
        raise RuntimeError("an installed vllm is already imported in this process")
    finder = _ReleaseFinder(root)
    sys.meta_path.insert(0, finder)
    vllm = importlib.import_module("vllm")
    vllm.__release_root__ = root
    names = {"utils": "vllm.v1.core.kv_cache_utils", "block_pool": "vllm.v1.core.block_pool",
             "manager": "vllm.v1.core.kv_cache_manager", "request": "vllm.v1.request",
             "interface": "vllm.v1.kv_cache_interface", "stats": "vllm.v1.metrics.stats"}
    return types.SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})
