"""Pieces every stage shares: where results go, the environment record, CSVs written row by row.

Nothing here imports torch at module level, so the orchestrator stays light and a stage that
cannot import torch still gets its failure recorded.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
T4_USABLE_BYTES = int(14.6 * 2**30)  # what a Colab T4 leaves a process (issue 13)
# What some stage imports besides torch, triton and numpy; the env stage reports each one.
OPTIONAL = ("pytest", "matplotlib", "transformers", "safetensors", "huggingface_hub",
            "tokenizers", "tqdm", "hypothesis", "pynvml")


def slug(gpu_name: str) -> str:
    """A folder name for a GPU: 'NVIDIA H200' -> 'NVIDIA_H200'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu_name.strip()).strip("_")
    if not cleaned:
        raise ValueError(f"gpu_name must contain a letter or digit, got {gpu_name!r}")
    return cleaned


def now() -> str:
    """UTC time, ISO 8601, to the second: sortable as text."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


class RowWriter:
    """A CSV written one flushed row at a time, so a killed stage still leaves its rows."""

    def __init__(self, path: Path, fields: list[str]) -> None:
        self.path, self.fields = Path(path), list(fields)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._handle = open(self.path, "a", newline="")
        self._writer = csv.DictWriter(self._handle, fieldnames=self.fields, extrasaction="ignore")
        if fresh:
            self._writer.writeheader()
            self._handle.flush()

    def write(self, row: dict) -> None:
        unknown = set(row) - set(self.fields)
        if unknown:
            raise ValueError(f"row has fields the CSV lacks: {sorted(unknown)}")
        self._writer.writerow({k: _cell(v) for k, v in row.items()})
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cell(value):
    """Floats to 6 significant digits; everything else as it is."""
    return f"{value:.6g}" if isinstance(value, float) else value


def read_rows(path: Path) -> list[dict]:
    """The rows of a CSV, as strings."""
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def driver_version() -> str | None:
    """The NVIDIA driver's version, from NVML or nvidia-smi; None when neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
    except Exception:
        return None


def environment(dry_run: bool) -> dict:
    """What ran: GPU name, driver, CUDA, torch, triton, numpy, Python; each None if missing."""
    info: dict = {"dry_run": dry_run, "python": platform.python_version(),
                  "machine": platform.machine(), "started_at": now(), "torch": None,
                  "triton": None, "numpy": None, "cuda": None, "device": "cpu", "gpu": None,
                  "driver": None, "compute_capability": None, "total_memory_bytes": None,
                  "multiprocessors": None, "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for name in ("numpy", "triton", "torch"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:  # recorded, never fatal: the stages say what they lack
            info[name] = f"missing ({type(error).__name__}: {error})"
    info["packages"] = {}
    for name in OPTIONAL:
        try:
            module = __import__(name)
            info["packages"][name] = getattr(module, "__version__", "present")
        except Exception:
            info["packages"][name] = None  # the stages that need it fail alone, saying so
    try:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available() and not dry_run:
            props = torch.cuda.get_device_properties(0)
            info.update(device="cuda", gpu=torch.cuda.get_device_name(0),
                        compute_capability=f"{props.major}.{props.minor}",
                        total_memory_bytes=props.total_memory,
                        multiprocessors=props.multi_processor_count, driver=driver_version())
    except Exception as error:
        info["torch_error"] = f"{type(error).__name__}: {error}"
    return info


def results_folder(info: dict) -> Path:
    """bench/results/<gpu-name>/ for a GPU run; a dry run names its folder after the CPU."""
    return RESULTS / slug(info["gpu"] or f"dry-run-{info['machine']}")


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)
