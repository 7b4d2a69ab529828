"""Everything the book needs a GPU for, measured in one command of at most 8 minutes.

    python3 -m bench.gpu_check --out "$OUT"   # on the GPU machine (or: make gpu-check OUT=$OUT)
    python3 -m bench.gpu_check --dry-run      # on a CPU: tiny sizes, Triton's interpreter (CI)

It needs Python with torch and triton (CUDA builds on a GPU), numpy, matplotlib, pytest; and
for the chapters' full-size runs transformers, safetensors, huggingface_hub and tokenizers. It
installs nothing and downloads nothing: ``minipaged`` is imported from this working tree, and
the Hugging Face model the chapters load is replaced by a random one of the same shape. The
``env`` stage prints which versions it found, and a stage whose needs are missing fails alone.

Stages, in order, each in its own process with its own time cap (seconds, ``--budget`` in all):

=============  ===  ================================================================
env             15  env.json: GPU, driver, CUDA, torch, triton, numpy, Python
kernel_tests    60  tests/test_kernels.py with the kernels compiled for the GPU
kernels         75  bench/kernel_speed.py: paged vs contiguous, decode and extend, B = 1..64
hub             40  a random Qwen2.5-0.5B stand-in in a private Hugging Face cache
engine          70  LLM.generate, fp16, real geometry: mixed and starved workloads
syncs           25  host-device syncs per engine step
prefix          40  chapter 8's prefix cache: shared prompt, cold and warm TTFT (skipped
                    where minipaged.prefix_cache does not exist)
serving         90  chapter 13's driver: four KV cache managers, eight windows and the
                    study's pool, Poisson arrivals (skipped without minipaged.serving)
chapter_NN    rest  chapters 1, 5, 6, 7, 8, 9, 11 at full size, 14.6 GiB cap each, side by
                    side (each cell's pinned host bytes beside its GPU memory)
=============  ===  ================================================================

Results go to bench/results/<gpu-name>/ (a dry run: build/gpu_check_dry/): one CSV per stage,
written row by row, env.json, stages.csv (each stage's status and time) and logs/. With
``--out DIR``, DIR/gpu_check_results.tar.gz is rewritten after every stage (unpack it in
bench/results/) and DIR/gpu_check.log holds the whole console. A stage that fails or runs out
of time is recorded and the next one starts; the exit status is 0 unless nothing ran (with
``--strict``, as CI runs the dry run: unless every stage passed or was skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path

if not __package__:  # run by its path (python3 bench/gpu_check): the repository root replaces
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # this folder's generic names
from bench.gpu_check.common import ROOT, RowWriter, now, slug, write_json  # noqa: E402

# (stage, cap in seconds); the chapters run together at the end with whatever time is left.
PLAN = [("env", 15), ("kernel_tests", 60), ("kernels", 75), ("hub", 40), ("engine", 70),
        ("syncs", 25), ("prefix", 40), ("serving", 90)]
PARALLEL = ["chapter_01", "chapter_05", "chapter_05b", "chapter_06", "chapter_06b", "chapter_07",
            "chapter_07b", "chapter_07c", "chapter_08", "chapter_09", "chapter_11", "chapter_14"]
SKIP_CODE = 3  # a worker's exit status meaning "skipped: does not apply here"
STAGE_FIELDS = ["stage", "status", "seconds", "timeout_s", "returncode", "note"]
BUDGET = 480
DRY_SLACK = 3  # a dry run's caps and budget are this many times longer: a busy CI CPU is slow


def stage_environment(dry_run: bool, hf_home: Path) -> dict:
    """The environment of a stage's process: interpreter on or off, offline, no notebook cache."""
    env = dict(os.environ)
    for name in ("TRITON_INTERPRET", "MINIPAGED_SHARE_EXECUTION", "MINIPAGED_DEVICE",
                 "MINIPAGED_SCALE"):
        env.pop(name, None)  # the Makefile exports some of these for the CPU test run
    paths = [str(ROOT), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONUNBUFFERED="1",
               MPLBACKEND="Agg", HF_HOME=str(hf_home), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    if dry_run:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", MINIPAGED_DEVICE="cpu",
                   MINIPAGED_SCALE="small")
    else:
        env.update(MINIPAGED_DEVICE="cuda", MINIPAGED_SCALE="full")
    return env


class Stage:
    """One stage's process: started, its output copied to the console and its log, stopped."""

    def __init__(self, name: str, args, env: dict, timeout: float, console,
                 threads: int | None = None) -> None:
        self.name, self.timeout, self.console = name, timeout, console
        if threads:  # processes side by side share the CPU's cores
            env = dict(env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.log_path = args.results / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "bench.gpu_check", "--stage", name,
                   "--results", str(args.results), "--deadline", str(time.time() + timeout)]
        if args.dry_run:
            command.append("--dry-run")
        self.start = time.time()
        self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace",
                                        start_new_session=True)
        self.tail: list[str] = []
        self.reader = threading.Thread(target=self._copy, daemon=True)
        self.reader.start()

    def _copy(self) -> None:
        with open(self.log_path, "a") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                self.console(f"[{self.name}] {line.rstrip()}")
                self.tail = (self.tail + [line.rstrip()])[-20:]

    def wait(self, until: float) -> dict:
        """Wait for the process until the given time; stop it (its whole group) if it is late."""
        timed_out = False
        try:
            self.process.wait(timeout=max(0.0, until - time.time()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.reader.join(timeout=5)
        code = self.process.returncode
        status = ("timeout" if timed_out else "ok" if code == 0 else
                  "skipped" if code == SKIP_CODE else "error")
        note = next((line for line in reversed(self.tail) if line.strip()), "")
        return {"stage": self.name, "status": status, "seconds": round(time.time() - self.start, 1),
                "timeout_s": round(self.timeout), "returncode": code, "note": note[-300:]}


def pack(results: Path, out: Path | None) -> None:
    """Rewrite out/gpu_check_results.tar.gz from the results folder (atomically)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "gpu_check_results.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as archive:
        archive.add(results, arcname=results.name)
    tmp.replace(out / "gpu_check_results.tar.gz")


def orchestrate(args) -> int:
    """Run the stages in order, each capped, recording each; pack the results after each."""
    start = time.time()
    slack = DRY_SLACK if args.dry_run else 1
    deadline = start + args.budget * slack
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    log_file = open(args.out / "gpu_check.log", "a") if args.out else None

    def console(line: str) -> None:
        stamped = f"{time.time() - start:6.1f}s {line}"
        print(stamped, flush=True)
        if log_file:
            log_file.write(stamped + "\n")
            log_file.flush()

    if args.results.exists():  # a rerun replaces the last run's results
        shutil.rmtree(args.results)
    args.results.mkdir(parents=True)
    hf_home = Path(tempfile.mkdtemp(prefix="gpu_check_hf_"))
    env = stage_environment(args.dry_run, hf_home)
    wanted = set(args.stages or [name for name, _ in PLAN] + PARALLEL)
    console(f"gpu_check: {'dry run on the CPU' if args.dry_run else 'GPU run'}, budget "
            f"{args.budget * slack:.0f} s, results in {args.results}")
    rows = []
    with RowWriter(args.results / "stages.csv", STAGE_FIELDS) as writer:
        def record(row: dict) -> None:
            rows.append(row)
            writer.write(row)
            console(f"== {row['stage']}: {row['status']} in {row['seconds']} s "
                    f"(cap {row['timeout_s']} s) {row['note'] if row['status'] != 'ok' else ''}")
            pack(args.results, args.out)

        sequential = [(name, cap) for name, cap in PLAN if name in wanted]
        for index, (name, cap) in enumerate(sequential):
            later = len(sequential) - index - 1 + (1 if wanted & set(PARALLEL) else 0)
            timeout = min(cap * slack, deadline - time.time() - 10 * later)
            if timeout < 5:
                record({"stage": name, "status": "not run", "seconds": 0, "timeout_s": 0,
                        "returncode": "", "note": "no time left in the budget"})
                continue
            stage = Stage(name, args, env, timeout, console)
            record(stage.wait(stage.start + timeout))
        parallel = [name for name in PARALLEL if name in wanted]
        if parallel:
            timeout = deadline - time.time()
            if timeout < 5:
                for name in parallel:
                    record({"stage": name, "status": "not run", "seconds": 0, "timeout_s": 0,
                            "returncode": "", "note": "no time left in the budget"})
            else:
                threads = max(1, (os.cpu_count() or 1) // len(parallel))
                running = [Stage(name, args, env, timeout, console, threads)
                           for name in parallel]
                for stage in running:
                    record(stage.wait(stage.start + timeout))
    env_path = args.results / "env.json"
    info = json.loads(env_path.read_text()) if env_path.exists() else {"dry_run": args.dry_run}
    info.update(finished_at=now(), seconds=round(time.time() - start, 1),
                stages={row["stage"]: row["status"] for row in rows})
    write_json(env_path, info)
    pack(args.results, args.out)
    shutil.rmtree(hf_home, ignore_errors=True)
    summary = ", ".join(f"{row['stage']} {row['status']}" for row in rows)
    console(f"gpu_check done in {time.time() - start:.0f} s: {summary}")
    if args.out:
        console(f"results: {args.out / 'gpu_check_results.tar.gz'} (unpack in bench/results/)")
    if log_file:
        log_file.close()
    ran = [row for row in rows if row["status"] in ("ok", "error", "timeout", "skipped")]
    failed = [row["stage"] for row in rows if row["status"] not in ("ok", "skipped")]
    if args.strict and failed:
        console(f"--strict: {', '.join(failed)} did not pass")
        return 1
    return 0 if ran else 1


def work(args) -> int:
    """Run one stage in this process (the orchestrator starts one such process per stage)."""
    from bench.gpu_check import stages

    ctx = stages.Context(args.results, args.dry_run, args.deadline)
    try:
        stages.STAGES[args.stage](ctx)
    except stages.Skip as reason:
        print(f"skipped: {reason}", flush=True)
        return SKIP_CODE
    except Exception:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    return 0


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (fast), else from torch in a throwaway process."""
    commands = [["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "--id=0"],
                [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                 "if torch.cuda.is_available() else '')"]]
    for command in commands:
        try:
            probe = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0 and probe.stdout.strip():
            return probe.stdout.strip().splitlines()[0]
    return "unknown-gpu"


def default_results(dry_run: bool) -> Path:
    """bench/results/<gpu-name>/ on a GPU; build/gpu_check_dry/ for a dry run."""
    if dry_run:
        return ROOT / "build" / "gpu_check_dry"
    return ROOT / "bench" / "results" / slug(gpu_name())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU, Triton's interpreter (what CI runs)")
    parser.add_argument("--out", type=Path, help="also pack the results and the log here")
    parser.add_argument("--results", type=Path, help="results folder (default: "
                        "bench/results/<gpu-name>/, or build/gpu_check_dry/ for a dry run)")
    parser.add_argument("--budget", type=float, default=BUDGET, help="seconds for all stages")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 if any stage fails or runs out of time (CI)")
    parser.add_argument("--stages", nargs="+", metavar="STAGE",
                        choices=[name for name, _ in PLAN] + PARALLEL, help="only these")
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        return work(args)
    args.results = (args.results or default_results(args.dry_run)).resolve()
    args.out = args.out.resolve() if args.out else None
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
