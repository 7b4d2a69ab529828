"""Where one engine step's time goes on a CPU: bench/engine.py's workload, step by step.

The engine of chapter 7 serves bench/engine.py's 32 prompts (greedy, prefix caching off, the
batched CPU attention of ``attention_backend="auto"``), driven one step at a time through its own
public pieces: ``scheduler.schedule()`` then ``execute(out)``, which is what ``LLMEngine.step``
does. A step is a *decode step* when every scheduled request brings one token, a *mixed step*
otherwise (prompt chunks, alone or beside decodes).

Two measurements, both from ``torch.profiler``:

* **The breakdown** (``with_stack=True``, which also records every Python call): each moment of
  a step is charged to the innermost of these that holds it: the linear layers (``nn.Linear``,
  ``aten::addmm``/``mm``), attention (``aten::scaled_dot_product_attention``), the table's
  gathers (``_gather_group``: the blocks of every context copied into a padded batch), the KV
  store (``store_kv``), the batching copies around attention (the rest of
  ``batched_paged_attention``: query rows in, output rows out), rotary (``RotaryEmbedding``,
  ``apply_rotary``), sampling (``rows_to_sample``, ``sample``), the step's metadata and its
  checks (``prepare_inputs``, ``plan_batched_attention``, ``_check_inputs``), the scheduler's and
  the pool's bookkeeping (``schedule``, ``update_from_output``, ``forget``), other tensor
  operations (norms, the MLP's activation, residual adds, the embedding), and the rest: Python
  between them. Recording every Python call slows Python down, so the profiled step is longer
  than a real one and the Python shares are overstated; the CSV gives both step times.
* **The share inside torch's compute kernels** (no stack, no Python tracer: only aten operators):
  the time inside top-level aten operators over the step's time.

The run is repeated ``--repeats`` times after one warm-up; each category keeps its smallest
mean per step (the repeats least disturbed by other jobs), at each thread count
(``torch.set_num_threads``). Timings are reported, never asserted.

    python -m bench.step_breakdown          # writes bench/results/step_breakdown.csv
    python -m bench.step_breakdown --quick  # 1 repeat at 1 thread, no CSV
"""
from __future__ import annotations

import argparse
import inspect
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.engine import (  # bench/engine.py's machine note, prompts, answers and CSVs
    add_machine_option,
    machine_note,
    workload,
    write_results,
)
from minipaged import LLM, SamplingParams, kernels, sampling
from minipaged import engine as engine_module
from minipaged import model as model_module
from minipaged import scheduler as scheduler_module
from minipaged.model import ModelConfig, random_model

RESULTS = Path(__file__).resolve().parent / "results"
CATEGORIES = ["linear layers", "attention (SDPA)", "table gathers", "KV store",
              "batching copies", "rotary", "other tensor ops", "sampling",
              "metadata and checks", "scheduler and pool", "the rest (Python between them)"]
FIELDS = ["threads", "step", "steps", "tokens_per_step", "category", "ms_per_step", "share",
          "machine"]


def _where(function) -> tuple[str, int, int]:
    """(file name, first line, last line) of a function, to find its frames in a trace."""
    function = inspect.unwrap(getattr(function, "fget", function))
    lines, first = inspect.getsourcelines(function)
    return Path(inspect.getsourcefile(function)).name, first, first + len(lines) - 1


NAMED = [  # innermost wins; functions found by file and line, as the trace names frames
    (model_module.RotaryEmbedding.forward, "rotary"), (model_module.apply_rotary, "rotary"),
    (model_module.apply_rotary_, "rotary"),
    (kernels._gather_group, "table gathers"), (kernels.store_kv, "KV store"),
    (kernels.batched_paged_attention, "batching copies"),
    (kernels.plan_batched_attention, "metadata and checks"),
    (model_module._check_inputs, "metadata and checks"),
    (engine_module.LLMEngine.prepare_inputs, "metadata and checks"),
    (engine_module.LLMEngine.rows_to_sample, "sampling"), (sampling.sample, "sampling"),
    (scheduler_module.Scheduler.update_from_output, "scheduler and pool"),
    (engine_module.LLMEngine.forget, "scheduler and pool"),
]
LINEAR_OPS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}


def frame_category(name: str, places) -> str | None:
    """The category of a Python frame event named like 'minipaged/model.py(566): forward'."""
    if name.startswith("torch/nn/modules/linear.py"):
        return "linear layers"
    try:
        path, rest = name.split("(", 1)
        line = int(rest.split(")", 1)[0])
    except ValueError:
        return None
    for (file, first, last), category in places:
        if path.endswith(file) and first <= line <= last:
            return category
    return None


def op_category(name: str) -> str | None:
    if name in LINEAR_OPS:
        return "linear layers"
    if "scaled_dot_product" in name:
        return "attention (SDPA)"
    return "other tensor ops" if name.startswith("aten::") else None


def attribute(events: list[dict], places) -> dict:
    """Per step window ('step:decode'/'step:mixed'), the time charged to each category."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    totals = {"decode": defaultdict(float), "mixed": defaultdict(float)}
    counts = defaultdict(int)
    stack: list[tuple[float, str | None, str | None]] = []  # (end, category, step kind)
    last_ts, current = None, None

    def charge(until):
        nonlocal last_ts
        if last_ts is not None and stack and until > last_ts:
            kind = next((k for _, _, k in reversed(stack) if k), None)
            named = [c for _, c, _ in reversed(stack) if c]  # innermost first
            # a plain tensor op is charged to the named function around it, if any
            category = next((c for c in named if c != "other tensor ops"),
                            "other tensor ops" if named else None)
            if kind:
                totals[kind][category or "the rest (Python between them)"] += until - last_ts
        last_ts = until

    for event in events:
        start, end = event["ts"], event["ts"] + event["dur"]
        while stack and stack[-1][0] <= start:
            charge(stack[-1][0])
            stack.pop()
        charge(start)
        name, kind, category = event["name"], None, None
        if name.startswith("step:"):
            kind = name.split(":", 1)[1]
            counts[kind] += 1
        elif name == "schedule":
            category = "scheduler and pool"
        elif event.get("cat") == "python_function":
            category = frame_category(name, places)
        else:
            category = op_category(name)
        stack.append((end, category, kind))
        current = end
    while stack:
        charge(stack[-1][0])
        stack.pop()
    del current
    return totals, counts


def run_steps(llm, prompts, params):
    """Serve the workload one step at a time; each step inside a record_function of its kind."""
    engine = llm.llm_engine
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, param)
    while engine.has_unfinished_requests():
        with record_function("schedule"):
            out = engine.scheduler.schedule()
        counts = out.num_scheduled_tokens.values()
        kind = "decode" if max(counts) == 1 else "mixed"
        with record_function(f"step:{kind}"):
            engine.execute(out)


def profiled(llm, prompts, params, with_stack: bool):
    with profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof:
        run_steps(llm, prompts, params)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def kernel_share(events) -> dict:
    """Per step kind: time inside top-level aten operators, and the steps' whole time (µs)."""
    steps = [e for e in events if e["name"].startswith("step:")]
    ops = sorted((e for e in events if e["name"].startswith("aten::")), key=lambda e: e["ts"])
    inside, whole = defaultdict(float), defaultdict(float)
    for step in steps:
        kind, start, end = step["name"].split(":")[1], step["ts"], step["ts"] + step["dur"]
        whole[kind] += step["dur"]
        reach = start
        for op in ops:
            if op["ts"] >= end:
                break
            if op["ts"] >= reach and op["ts"] >= start:  # top level: not inside the last one
                inside[kind] += op["dur"]
                reach = op["ts"] + op["dur"]
    return {k: inside[k] / whole[k] for k in whole}


def step_times(llm, prompts, params) -> tuple[dict, dict]:
    """Mean wall-clock ms per decode and per mixed step, without a profiler; mean tokens each."""
    engine, times, tokens = llm.llm_engine, defaultdict(list), defaultdict(list)
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        engine.add_request(f"t{i}", prompt, param)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        out = engine.scheduler.schedule()
        kind = "decode" if max(out.num_scheduled_tokens.values()) == 1 else "mixed"
        engine.execute(out)
        times[kind].append(time.perf_counter() - start)
        tokens[kind].append(out.total_num_scheduled_tokens)
    return ({k: 1e3 * sum(v) / len(v) for k, v in times.items()},
            {k: sum(v) / len(v) for k, v in tokens.items()})


def measure(threads: int, repeats: int) -> list[dict]:
    torch.set_num_threads(threads)
    config = ModelConfig.small(num_layers=2)
    model = random_model(config, seed=0)
    prompts, answers = workload(config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in answers]
    llm = LLM(model=model, max_model_len=config.max_position_embeddings,
              enable_prefix_caching=False)
    places = [(_where(f), c) for f, c in NAMED]
    _, tokens = step_times(llm, prompts, params)  # warm-up; the same tokens every run
    fastest: dict = {}  # per step kind: the profiled repeat whose steps were fastest
    plain, share = defaultdict(list), defaultdict(list)
    for _ in range(repeats):  # interleaved: plain, light profile, stack profile
        for kind, ms in step_times(llm, prompts, params)[0].items():
            plain[kind].append(ms)
        for kind, value in kernel_share(profiled(llm, prompts, params, False)).items():
            share[kind].append(value)
        totals, counts = attribute(profiled(llm, prompts, params, True), places)
        for kind in ("decode", "mixed"):
            per_step = {c: totals[kind][c] / 1e3 / counts[kind] for c in CATEGORIES}
            if kind not in fastest or sum(per_step.values()) < sum(fastest[kind][0].values()):
                fastest[kind] = per_step, counts[kind]
    rows = []
    for kind in ("decode", "mixed"):
        per_step, steps = fastest[kind]
        whole = sum(per_step.values())
        per_step["step, profiled with stacks"] = whole
        per_step["step, no profiler"] = min(plain[kind])
        for name, value in per_step.items():
            rows.append(dict(threads=threads, step=kind, steps=steps,
                             tokens_per_step=round(tokens[kind], 1), category=name,
                             ms_per_step=round(value, 4), share=round(value / whole, 4)))
        rows.append(dict(threads=threads, step=kind, steps=steps,
                         tokens_per_step=round(tokens[kind], 1),
                         category="inside torch's compute kernels (share, no stacks)",
                         ms_per_step="", share=round(max(share[kind]), 4)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 thread, no CSV")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    add_machine_option(parser)
    args = parser.parse_args()
    repeats, threads = (1, [1]) if args.quick else (args.repeats, args.threads)
    machine = machine_note(args.machine)
    rows = [dict(row, machine=machine) for n in threads for row in measure(n, repeats)]
    for row in rows:
        print(f"{row['threads']} thr  {row['step']:6} {row['category']:42} "
              f"{row['ms_per_step'] if row['ms_per_step'] != '' else '':>8}  "
              f"{100 * row['share']:5.1f}%")
    if not args.quick:
        write_results("step_breakdown.csv", FIELDS, rows)


if __name__ == "__main__":
    main()
