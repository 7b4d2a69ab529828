"""The stages of the GPU check. Each runs in its own process (see __main__.py) as ``run(ctx)``.

A stage writes its CSVs row by row into ``ctx.results``, so that a stage stopped at its time
cap still leaves what it measured. It raises ``Skip`` to say it does not apply here (then it
is recorded as skipped, not failed), and checks ``ctx.time_left()`` to stop early by itself.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_check.common import ROOT, T4_USABLE_BYTES, RowWriter, environment, write_json


class Skip(Exception):
    """This stage does not apply on this machine or at this commit."""


@dataclass
class Context:
    """What a stage needs to know: where to write, whether this is a dry run, its deadline."""

    results: Path
    dry_run: bool
    deadline: float = float("inf")
    log: object = print
    extra: dict = field(default_factory=dict)

    def time_left(self) -> float:
        return self.deadline - time.time()

    def device(self):
        import torch

        return torch.device("cpu" if self.dry_run else "cuda")

    def dtype(self):
        import torch

        return torch.float32 if self.dry_run else torch.float16

    def require_cuda(self) -> None:
        import torch

        if not self.dry_run and not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device (torch.cuda.is_available() is False)")


# ---- env ----

def env(ctx: Context) -> None:
    """env.json: the GPU's name, driver, CUDA, torch, triton, numpy, Python."""
    info = environment(ctx.dry_run)
    info.update(ctx.extra.get("env", {}))
    write_json(ctx.results / "env.json", info)
    for key in ("gpu", "driver", "cuda", "torch", "triton", "numpy", "python"):
        ctx.log(f"{key:>8}: {info.get(key)}")
    missing = [name for name, version in info["packages"].items() if version is None]
    ctx.log(f"packages: {info['packages']}" + (f"; missing: {missing}" if missing else ""))
    if not ctx.dry_run and info["device"] != "cuda":
        raise RuntimeError("no CUDA device: the GPU stages will fail; run with --dry-run on a CPU")


# ---- kernel tests ----

DRY_TESTS = ["tests/test_kernels.py::test_check_block_size_accepts_powers_of_two",
             "tests/test_kernels.py::test_decode_matches_reference_at_every_block_size"
             "[position-16]",
             "tests/test_kernels.py::test_decode_matches_reference_at_every_block_size[tile-1]"]


# Asserts that backend="auto" on CPU tensors is the torch reference; moved to CUDA by the shim,
# "auto" rightly picks the Triton kernel instead, so on the GPU it would fail by construction.
CPU_ONLY_TEST = "tests/test_kernels.py::test_auto_backend_on_cpu_is_the_reference_exactly"


class ResultRows:
    """A pytest plugin writing one CSV row per test as it finishes."""

    def __init__(self, writer: RowWriter) -> None:
        self.writer, self.counts = writer, {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
            message = str(report.longrepr).splitlines()[-1][:300] if report.failed else ""
            self.writer.write({"test": report.nodeid, "outcome": report.outcome,
                               "seconds": report.duration, "message": message})


def kernel_tests(ctx: Context) -> None:
    """tests/test_kernels.py with every kernel compiled for the GPU (bench.gpu_check.cuda_tests)."""
    import pytest

    ctx.require_cuda()
    os.environ["GPU_CHECK_DEVICE"] = "cpu" if ctx.dry_run else "cuda"
    selection = DRY_TESTS if ctx.dry_run else ["tests/test_kernels.py", "-m", "not slow",
                                               "--deselect", CPU_ONLY_TEST]
    os.chdir(ROOT)
    with RowWriter(ctx.results / "kernel_tests.csv",
                   ["test", "outcome", "seconds", "message"]) as writer:
        rows = ResultRows(writer)
        code = pytest.main([*selection, "-q", "-p", "bench.gpu_check.cuda_tests", "-p",
                            "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
                           plugins=[rows])
    ctx.log(f"kernel tests: {rows.counts} (pytest exit code {int(code)})")
    if rows.counts.get("failed"):
        raise RuntimeError(f"{rows.counts['failed']} kernel tests failed on the GPU")


# ---- kernels benchmark ----

def kernels(ctx: Context) -> None:
    """bench/kernel_speed.py's grid: decode and extend, paged against contiguous, B = 1..64."""
    import torch

    ctx.require_cuda()
    from bench import kernel_speed as bench
    device = ctx.device()
    if ctx.dry_run:
        gpu, peak = "CPU dry run", None
    else:
        gpu = torch.cuda.get_device_name(device)
        peak = bench.peak_bandwidth(gpu, torch.cuda.get_device_properties(device).total_memory)
    with RowWriter(ctx.results / "kernels.csv", bench.FIELDS) as writer:
        count = bench.measure(bench.GRIDS["dry" if ctx.dry_run else "full"], writer, device,
                              gpu, peak, log=ctx.log)
    ctx.log(f"kernels: {count} rows")


# ---- the engine ----

def model_at_real_geometry(ctx: Context):
    """Qwen2.5-0.5B's shape on the device (a two-layer toy in a dry run), random weights.

    Loaded from the hub stage's stand-in checkpoint when it is there (seconds), else drawn.
    """
    from bench.gpu_check.chapters import real_geometry, stand_in_snapshot
    from minipaged.huggingface import load_model
    from minipaged.model import random_model

    snapshot = stand_in_snapshot()
    if snapshot is not None:
        return load_model(snapshot, dtype=ctx.dtype(), device=ctx.device())
    return random_model(real_geometry(small=ctx.dry_run), seed=0, dtype=ctx.dtype(),
                        device=ctx.device())


def lognormal_lengths(num: int, cap: int, seed: int = 0) -> list[int]:
    """Chapter 2's mix: lognormal lengths, median 180 and mean 260, clipped to [1, cap]."""
    import numpy as np

    sigma = np.sqrt(2 * np.log(260 / 180))
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(180), sigma, num).round(), 1, cap).astype(int).tolist()


@dataclass(frozen=True)
class Workload:
    """Requests of given prompt lengths, each answering new_tokens tokens, on a pool of tokens."""

    name: str
    prompt_lens: tuple[int, ...]
    new_tokens: int
    pool_tokens: int


def engine_workloads(dry_run: bool, max_len: int) -> list[Workload]:
    """The mixed workload, and chapter 7's starved one scaled (pool at the seed's ratio)."""
    mixed_n, new, starved_n, answer = (4, 4, 4, 8) if dry_run else (64, 128, 96, 384)
    mixed = tuple(lognormal_lengths(mixed_n, max_len - new))
    starved_prompts = (9,) * starved_n
    demand = starved_n * (9 + answer)
    seed_ratio = 77_312 / (200 * (9 + 1000))  # the seed's pool against its peak demand
    return [Workload("mixed", mixed, new, sum(mixed) + mixed_n * new + 16 * mixed_n),
            Workload("starved workload, ample pool", starved_prompts, answer,
                     demand + 16 * starved_n),
            Workload("starved workload, starved pool", starved_prompts, answer,
                     max(int(demand * seed_ratio), 9 + answer + 16))]


ENGINE_FIELDS = ["gpu", "workload", "requests", "prompt_tokens", "new_tokens", "pool_tokens",
                 "pool_blocks", "seconds", "output_tokens_per_s", "total_tokens_per_s",
                 "num_steps", "ms_per_step", "num_preemptions", "peak_num_used_blocks",
                 "same_tokens_as_ample", "dtype", "layers"]


def _generate(llm, prompts, new_tokens):
    from minipaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine(ctx: Context) -> None:
    """Throughput of LLM.generate in fp16 at the real geometry: mixed, starved, ample pools."""
    import gc

    import torch

    from minipaged import LLM

    ctx.require_cuda()
    device, model = ctx.device(), model_at_real_geometry(ctx)
    config = model.config
    per_token = config.model_shape(next(model.parameters()).element_size()).kv_bytes_per_token
    max_len = 64 if ctx.dry_run else 4096  # the longest mixed prompt, plus its answer
    gpu = "CPU dry run" if ctx.dry_run else torch.cuda.get_device_name(device)
    generator = torch.Generator().manual_seed(0)
    ample_tokens, prompt_sets = None, {}
    with RowWriter(ctx.results / "engine.csv", ENGINE_FIELDS) as writer:
        for work in engine_workloads(ctx.dry_run, max_len):
            if ctx.time_left() < 15:
                ctx.log(f"engine: no time left for {work.name!r}")
                break
            if work.prompt_lens not in prompt_sets:  # both starved runs get the same requests
                prompt_sets[work.prompt_lens] = [
                    torch.randint(1, config.vocab_size, (n,), generator=generator).tolist()
                    for n in work.prompt_lens]
            prompts = prompt_sets[work.prompt_lens]
            llm = LLM(model=model, kv_cache_memory_bytes=work.pool_tokens * per_token,
                      max_model_len=max(work.prompt_lens) + work.new_tokens,
                      max_num_batched_tokens=2048, enable_prefix_caching=False)
            # Compile (or specialise) the kernels for this engine's cache before timing it.
            _generate(llm, prompts[:2], 2)
            engine_state = llm.llm_engine
            before = engine_state.stats()
            _synchronize(device)
            start = time.perf_counter()
            outputs = _generate(llm, prompts, work.new_tokens)
            _synchronize(device)
            seconds = time.perf_counter() - start
            stats = engine_state.stats()
            steps = stats["num_steps"] - before["num_steps"]
            tokens = [o.outputs[0].token_ids for o in outputs]
            same = ""
            if work.name.endswith("ample pool"):
                ample_tokens = tokens
            elif work.name.endswith("starved pool") and ample_tokens is not None:
                same = sum(a == b for a, b in zip(tokens, ample_tokens)) / len(tokens)
            new = len(prompts) * work.new_tokens
            writer.write({
                "gpu": gpu, "workload": work.name, "requests": len(prompts),
                "prompt_tokens": sum(map(len, prompts)), "new_tokens": work.new_tokens,
                "pool_tokens": work.pool_tokens, "pool_blocks": engine_state.pool.num_blocks,
                "seconds": seconds, "output_tokens_per_s": new / seconds,
                "total_tokens_per_s": (new + sum(map(len, prompts))) / seconds,
                "num_steps": steps, "ms_per_step": seconds / max(steps, 1) * 1e3,
                "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
                "peak_num_used_blocks": stats["peak_num_used_blocks"], "same_tokens_as_ample": same,
                "dtype": str(ctx.dtype()).removeprefix("torch."),
                "layers": config.num_hidden_layers})
            ctx.log(f"engine {work.name:>32}: {new / seconds:9,.1f} output tok/s, {steps} steps, "
                    f"{stats['num_preemptions']} preemptions")
            del llm, engine_state, outputs
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


# ---- host-device syncs per engine step ----

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class SyncCounter:
    """Count host reads of device tensors (each a sync on a GPU), by method and call site.

    On CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` also turns every synchronizing
    operation into a warning; those are counted too, by the line that caused them.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.reads = self.syncs = 0
        self.sites: dict[tuple[str, str], int] = {}
        self._saved: dict[str, object] = {}

    def _site(self, depth: int) -> str:
        frame = sys._getframe(depth)
        return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"

    def __enter__(self) -> SyncCounter:
        import torch

        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if tensor.device.type == self.device_type:
                    self.reads += 1
                    key = ("host read", f"{_name} at {self._site(2)}")
                    self.sites[key] = self.sites.get(key, 0) + 1
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counted)
        self._warnings = warnings.catch_warnings(record=True)
        self._records = self._warnings.__enter__()
        warnings.simplefilter("always")
        if self.device_type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def take(self) -> tuple[int, int]:
        """(host reads, CUDA sync warnings) since the last take."""
        syncs = [w for w in self._records if "synchroniz" in str(w.message).lower()]
        for record in syncs:
            key = ("cuda sync", f"{Path(record.filename).name}:{record.lineno}")
            self.sites[key] = self.sites.get(key, 0) + 1
        self._records.clear()
        reads, self.reads = self.reads, 0
        return reads, len(syncs)

    def __exit__(self, *exc) -> None:
        import torch

        if self.device_type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        self._warnings.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def syncs(ctx: Context) -> None:
    """Host-device syncs in each engine step, at the real geometry, prefill and decode."""
    import torch

    from minipaged import LLM, SamplingParams

    ctx.require_cuda()
    device, model = ctx.device(), model_at_real_geometry(ctx)
    config = model.config
    generator = torch.Generator().manual_seed(1)
    lengths = (40, 9, 23, 17) if ctx.dry_run else (700, 180, 95, 2100, 300, 33, 1200, 410)
    pool_tokens = sum(lengths) + 64 * len(lengths)  # room for every request at once
    llm = LLM(model=model, kv_cache_memory_bytes=pool_tokens
              * config.model_shape(next(model.parameters()).element_size()).kv_bytes_per_token,
              max_model_len=256 if ctx.dry_run else 4096, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=6 if ctx.dry_run else 24, ignore_eos=True)
    _generate(llm, [[1] * 40, [2] * 3], 2)  # kernels compiled before anything is counted
    engine_state = llm.llm_engine
    for n in lengths:
        prompt = torch.randint(1, config.vocab_size, (n,), generator=generator).tolist()
        engine_state.add_request(f"sync-{n}", prompt, params)
    counter = SyncCounter(device.type)
    fields = ["step", "num_seqs", "num_tokens", "phase", "host_reads", "cuda_sync_warnings",
              "method"]
    method = ("torch.cuda.set_sync_debug_mode('warn') + Tensor host reads counted" if
              device.type == "cuda" else "Tensor host reads counted (CPU tensors: not syncs)")
    with RowWriter(ctx.results / "syncs.csv", fields) as writer, counter:
        step = 0
        while engine_state.has_unfinished_requests() and ctx.time_left() > 5:
            running_before = engine_state.num_computed_tokens
            counter.take()
            served = engine_state.step()
            _synchronize(device)
            reads, cuda_syncs = counter.take()
            tokens = engine_state.num_computed_tokens - running_before
            writer.write({"step": step, "num_seqs": len(served), "num_tokens": tokens,
                          "phase": "decode" if tokens == len(served) else "prefill",
                          "host_reads": reads, "cuda_sync_warnings": cuda_syncs,
                          "method": method})
            step += 1
    with RowWriter(ctx.results / "sync_sites.csv", ["kind", "site", "count"]) as writer:
        for (kind, site), count in sorted(counter.sites.items(), key=lambda kv: -kv[1]):
            writer.write({"kind": kind, "site": site, "count": count})
    ctx.log(f"syncs: {step} steps recorded; top sites: "
            f"{sorted(counter.sites.items(), key=lambda kv: -kv[1])[:3]}")


# ---- prefix caching (chapter 8), when it exists ----

def prefix_caching_available() -> str | None:
    """None when the package's LLM(enable_prefix_caching=True) has a manager to build, else
    why not."""
    if importlib.util.find_spec("minipaged.prefix_cache") is None:
        return "minipaged.prefix_cache does not exist at this commit (chapter 8 not merged)"
    importlib.import_module("minipaged.prefix_cache")
    llm_module = importlib.import_module("minipaged.llm")
    if (True, "split", False) not in getattr(llm_module, "KV_CACHE_MANAGER_CLASSES", {}):
        return "minipaged.llm maps no manager to enable_prefix_caching=True"
    return None


PREFIX_FIELDS = ["gpu", "experiment", "prefix_tokens", "enable_prefix_caching", "requests",
                 "new_tokens", "seconds", "ttft_ms", "num_computed_tokens"]


def prefix(ctx: Context) -> None:
    """16 requests on one 2,407-token prompt, caching off and on; cold/warm TTFT by length."""
    import torch

    from minipaged import LLM, SamplingParams

    reason = prefix_caching_available()
    if reason:
        raise Skip(reason)
    ctx.require_cuda()
    device, model = ctx.device(), model_at_real_geometry(ctx)
    config = model.config
    gpu = "CPU dry run" if ctx.dry_run else torch.cuda.get_device_name(device)
    shared_len, lengths = (40, (24, 40)) if ctx.dry_run else (2407, (128, 1024, 2048, 4096))
    num_requests, new_tokens = (4, 2) if ctx.dry_run else (16, 8)
    max_len = max(lengths) + 64
    per_token = config.model_shape(next(model.parameters()).element_size()).kv_bytes_per_token
    generator = torch.Generator().manual_seed(2)
    tokens = lambda n: torch.randint(1, config.vocab_size, (n,), generator=generator).tolist()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def timed(llm, prompts, params):
        _synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        _synchronize(device)
        return time.perf_counter() - start, outputs

    with RowWriter(ctx.results / "prefix.csv", PREFIX_FIELDS) as writer:
        shared = tokens(shared_len)
        for caching in (False, True):
            llm = LLM(model=model, enable_prefix_caching=caching, max_model_len=max_len,
                      kv_cache_memory_bytes=20 * max_len * per_token)
            timed(llm, [tokens(20)], one)  # compile before timing
            before = llm.llm_engine.num_computed_tokens
            seconds, _ = timed(llm, [list(shared) for _ in range(num_requests)],
                               SamplingParams(temperature=0, max_tokens=new_tokens,
                                              ignore_eos=True))
            writer.write({"gpu": gpu, "experiment": "requests on one shared prefix",
                          "prefix_tokens": shared_len, "enable_prefix_caching": caching,
                          "requests": num_requests, "new_tokens": new_tokens, "seconds": seconds,
                          "num_computed_tokens": llm.llm_engine.num_computed_tokens - before})
            ctx.log(f"prefix: {num_requests} x {shared_len} tokens, caching {caching}: "
                    f"{seconds:.3f} s")
            del llm
        llm = LLM(model=model, enable_prefix_caching=True, max_model_len=max_len,
                  kv_cache_memory_bytes=8 * max_len * per_token)
        timed(llm, [tokens(20)], one)
        for length in lengths:
            head = tokens(length)
            for label in ("cold", "warm"):
                seconds, outputs = timed(llm, [head + tokens(1)], one)
                ttft = outputs[0].metrics.time_to_first_token
                writer.write({"gpu": gpu, "experiment": f"time to first token, {label}",
                              "prefix_tokens": length, "enable_prefix_caching": True,
                              "requests": 1, "new_tokens": 1, "seconds": seconds,
                              "ttft_ms": (ttft if ttft is not None else seconds) * 1e3})
            ctx.log(f"prefix: TTFT at {length} tokens recorded")


# ---- serving under load (chapter 13), when it exists ----

SERVING_FIELDS = ["gpu", "pool_blocks", "max_model_len", "engine", "rate", "requests", "seconds",
                  "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
                  "mean_itl_ms", "mean_e2e_ms", "mean_normalized_ms", "mean_batch", "peak_batch",
                  "held_tokens", "used_tokens", "num_preemptions", "dtype", "layers"]


def serving(ctx: Context) -> None:
    """Chapter 13's driver on the GPU: chapter 7's engine with each KV cache manager, real forward
    passes at the real geometry, the pool of eight windows and the study's pool of 58,064 blocks
    (max_model_len 2,048), Poisson arrivals at multiples of the paged engine's flood throughput."""
    import gc

    import torch

    if importlib.util.find_spec("minipaged.serving") is None:
        raise Skip("minipaged.serving does not exist at this commit (chapter 13 not merged)")
    from minipaged.engine import LLMEngine
    from minipaged.serving import SERVING_ENGINES, make_trace, run_summary, serve

    ctx.require_cuda()
    device, model = ctx.device(), model_at_real_geometry(ctx)
    gpu = "CPU dry run" if ctx.dry_run else torch.cuda.get_device_name(device)
    window = 64 if ctx.dry_run else 2048
    pools = [8 * window // 16] if ctx.dry_run else [8 * window // 16, 58_064]
    num_requests, fractions = (4, (1.0,)) if ctx.dry_run else (100, (0.5, 1.0, 2.0))
    scale = window / 2048  # chapter 2's median and mean, scaled to the window

    def clock() -> float:
        _synchronize(device)
        return time.perf_counter()

    def trace(rate):
        return make_trace(num_requests, rate, seed=0, max_model_len=window, median=180 * scale,
                          mean=260 * scale)

    def one_run(writer, blocks, name, rate):
        manager_cls, scheduler_cls = SERVING_ENGINES[name]
        engine = LLMEngine(model, num_gpu_blocks=blocks, block_size=16, max_model_len=window,
                           kv_cache_manager_cls=manager_cls, scheduler_cls=scheduler_cls)
        start = time.perf_counter()
        summary = run_summary(serve(engine, trace(rate), clock=clock))
        seconds, preemptions = time.perf_counter() - start, engine.scheduler.num_preemptions
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if writer is not None:
            row = {"gpu": gpu, "pool_blocks": blocks, "max_model_len": window, "engine": name,
                   "rate": rate, "requests": num_requests, "seconds": seconds,
                   "num_preemptions": preemptions, "layers": model.config.num_hidden_layers,
                   "dtype": str(ctx.dtype()).removeprefix("torch.")}
            row.update({key: summary[key] for key in SERVING_FIELDS if key in summary})
            row.update({f"mean_{key}_ms": summary[f"mean_{key}"] * 1e3
                        for key in ("ttft", "tpot", "itl", "e2e", "normalized")})
            writer.write(row)
            ctx.log(f"serving: pool {blocks}, {name:>6} at {rate:8.2f}/s: "
                    f"{summary['mean_normalized'] * 1e3:8.2f} ms/token, batch "
                    f"{summary['mean_batch']:.1f}")
        return summary

    with RowWriter(ctx.results / "serving.csv", SERVING_FIELDS) as writer:
        for blocks in pools:
            if ctx.time_left() < 20:
                ctx.log(f"serving: no time left for the pool of {blocks} blocks")
                break
            first = next(iter(SERVING_ENGINES))  # the registry's first engine sets the rates
            anchor = one_run(None, blocks, first, 1e9)["request_throughput"]
            for name in SERVING_ENGINES:
                for fraction in fractions:
                    if ctx.time_left() < 15:
                        ctx.log("serving: stopped at the time cap")
                        return
                    one_run(writer, blocks, name, anchor * fraction)


# ---- the stand-in checkpoint, and the chapters at full size ----

def hub(ctx: Context) -> None:
    """Write the stand-in Qwen2.5-0.5B-Instruct (random, real shape) into HF_HOME."""
    from bench.gpu_check.chapters import fake_hub, real_geometry

    ctx.require_cuda()
    home = Path(os.environ["HF_HOME"])
    snapshot = fake_hub(home, real_geometry(small=ctx.dry_run), ctx.dtype(), ctx.device())
    size = sum(f.stat().st_size for f in snapshot.iterdir())
    ctx.log(f"hub: stand-in checkpoint at {snapshot} ({size / 2**20:,.1f} MiB)")


CHAPTERS = {"chapter_01": "01_kv_memory", "chapter_05": "05_paged_attention",
            "chapter_05b": "05_what_the_table_costs",
            "chapter_06": "06_model", "chapter_06b": "06_parity",
            "chapter_07": "07_scheduler",
            "chapter_07b": "07_the_llm", "chapter_07c": "07_under_load",
            "chapter_08": "08_prefix_caching", "chapter_09": "09_cache_salt",
            "chapter_11": "11_swap", "chapter_14": "14_eight_bit_cache"}
DRY_CELLS = 3  # the dry run executes the first cells of each chapter: setup, runtime, a check


def chapter(ctx: Context, name: str) -> None:
    """Run one chapter's notebook at full size under the T4 memory cap, cell by cell."""
    from bench.gpu_check.chapters import CELL_FIELDS, GLUE_FIELDS, run_chapter

    ctx.require_cuda()
    notebook = ROOT / "chapters" / f"{CHAPTERS[name]}.ipynb"
    with RowWriter(ctx.results / f"{name}_cells.csv", CELL_FIELDS) as cells, \
            RowWriter(ctx.results / f"{name}_glue.csv", GLUE_FIELDS) as glue:
        summary = run_chapter(notebook, cells, glue, None if ctx.dry_run else T4_USABLE_BYTES,
                              DRY_CELLS if ctx.dry_run else None, log=ctx.log)
    ctx.log(f"{name}: {summary}")
    if summary["errors"]:
        raise RuntimeError(f"{summary['errors']} cell(s) failed; first: {summary['first_error']}")


STAGES = {"env": env, "kernel_tests": kernel_tests, "kernels": kernels, "hub": hub,
          "engine": engine, "syncs": syncs, "prefix": prefix, "serving": serving,
          **{name: (lambda ctx, name=name: chapter(ctx, name)) for name in CHAPTERS}}
