"""Chapter 1's runtime helper: the device, Triton's interpreter and the version floors agree.

A GPU is simulated by patching torch.cuda before minipaged is first imported, in a fresh
process each time, since the interpreter is chosen on import."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy
import pytest

from minipaged.runtime import version_problems

ROOT = Path(__file__).resolve().parent.parent

SIMULATED_GPU = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.get_device_name = lambda device=None: "Simulated T4"
"""


def run(script: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("TRITON_INTERPRET", "MINIPAGED_DEVICE", "MINIPAGED_SCALE")}
    return subprocess.run([sys.executable, "-c", SIMULATED_GPU + textwrap.dedent(script)],
                          env=clean | env, capture_output=True, text=True, timeout=300)


@pytest.mark.heavy  # a subprocess that imports torch: seconds
def test_minipaged_device_cpu_on_a_gpu_machine_turns_the_interpreter_on():
    result = run("""
        import os
        from minipaged.runtime import Runtime
        runtime = Runtime.detect()
        print(os.environ.get("TRITON_INTERPRET"), runtime.device, runtime.dtype, runtime.scale)
    """, MINIPAGED_DEVICE="cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "cpu", "torch.float32", "small"]


@pytest.mark.heavy  # a subprocess that imports torch: seconds
def test_a_gpu_machine_left_alone_compiles_the_kernels():
    result = run("""
        import os
        from minipaged.runtime import Runtime
        runtime = Runtime.detect()
        print(os.environ.get("TRITON_INTERPRET"), runtime.device, runtime.dtype, runtime.scale)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "cuda", "torch.float16", "full"]


@pytest.mark.heavy  # a subprocess that imports torch: seconds
def test_cpu_chosen_after_import_but_before_triton_still_gets_the_interpreter():
    result = run("""
        import os, sys
        import minipaged.runtime as rt
        assert os.environ.get("TRITON_INTERPRET") is None
        sys.modules.pop("triton", None)  # as on a machine where nothing has imported it yet
        os.environ["MINIPAGED_DEVICE"] = "cpu"
        print(rt.Runtime.detect().device, os.environ.get("TRITON_INTERPRET"))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "1"]


@pytest.mark.heavy  # a subprocess that imports torch: seconds
def test_cpu_chosen_after_triton_was_compiled_for_says_so_loudly():
    result = run("""
        import os, warnings
        import minipaged  # on this simulated GPU: kernels compiled, triton imported
        import triton  # noqa: F401
        os.environ["MINIPAGED_DEVICE"] = "cpu"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            minipaged.runtime.Runtime.detect()
        print([str(w.message) for w in caught])
    """)
    assert result.returncode == 0, result.stderr
    assert "MINIPAGED_DEVICE=cpu" in result.stdout and "before importing minipaged" in result.stdout


@pytest.mark.heavy
def test_a_triton_kernel_runs_on_cpu_tensors_when_the_device_says_cpu():
    result = run("""
        import torch
        from minipaged.kernels import store_kv
        from minipaged.kv_cache import reference_store_kv
        key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
        slots = torch.tensor([5, -1, 0])
        ours, reference = torch.zeros(2, 2, 4, 2 * 64), torch.zeros(2, 2, 4, 2 * 64)
        store_kv(key, value, ours, slots, backend="triton")
        reference_store_kv(key, value, reference, slots)
        print(torch.equal(ours, reference))
    """, MINIPAGED_DEVICE="cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


@pytest.mark.parametrize("triton, numpy_version, interpreter, expected", [
    ("3.9.0", "2.4.6", True, []),
    ("3.6.0", "2.3.5", True, []),
    ("3.5.1", "2.4.6", False, []),  # compiled kernels do not go through numpy
    ("3.5.1", "2.4.6", True, ["numpy<2.4"]),
    ("3.6.0", "2.4.0rc1", True, ["numpy<2.4"]),
    ("3.3.1", "2.2.0", False, ["triton>=3.4"]),
    (None, "2.4.6", True, []),
])
def test_version_problems_name_the_fix(triton, numpy_version, interpreter, expected):
    problems = version_problems(triton, numpy_version, interpreter)
    assert len(problems) == len(expected)
    for problem, fix in zip(problems, expected):
        assert fix in problem


def test_the_installed_pair_runs_the_kernels():
    from importlib import metadata

    assert version_problems(metadata.version("triton"), numpy.__version__, True) == []


def test_the_triton_floor_is_the_same_everywhere():
    dependencies = re.search(r"^dependencies = (\[.*\])$", (ROOT / "pyproject.toml").read_text(),
                             re.M).group(1)
    assert '"triton>=3.4"' in dependencies
    requirements = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^triton>=3\.4\b", requirements, re.M)
    assert "3.4.0, 3.5.1, 3.6.0 and 3.9.0" in (ROOT / "book" / "colab.md").read_text()


def detected(monkeypatch, gpu: bool, **env: str):
    """Runtime.detect() with or without a (simulated) GPU and these environment variables."""
    import torch

    from minipaged.runtime import Runtime

    for name in ("MINIPAGED_DEVICE", "MINIPAGED_SCALE", "MINIPAGED_EXPECT_GPU",
                 "COLAB_RELEASE_TAG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated T4")
    return Runtime.detect()


def test_a_plain_cpu_machine_says_small_size_because_no_gpu(monkeypatch):
    text = str(detected(monkeypatch, gpu=False))
    assert text == ("Running on the CPU (Triton kernels under its interpreter), in float32, at "
                    "small sizes, because no GPU was found.")


def test_colab_without_a_gpu_prints_a_banner_saying_how_to_get_one(monkeypatch):
    for env in (dict(COLAB_RELEASE_TAG="release-colab"), dict(MINIPAGED_EXPECT_GPU="1")):
        lines = str(detected(monkeypatch, gpu=False, **env)).splitlines()
        assert lines[0] == lines[-1] == "=" * 78
        assert lines[1].startswith("NO GPU. Running on the CPU") and "no GPU was found" in lines[1]
        assert "Runtime > Change runtime type > T4 GPU" in lines[2]


def test_a_cpu_asked_for_is_no_alarm_and_a_gpu_is_named(monkeypatch):
    chosen = str(detected(monkeypatch, gpu=True, MINIPAGED_DEVICE="cpu",
                          COLAB_RELEASE_TAG="release-colab"))
    assert chosen.endswith("because MINIPAGED_DEVICE=cpu asks for it.") and "NO GPU" not in chosen
    assert str(detected(monkeypatch, gpu=True, COLAB_RELEASE_TAG="release-colab")) == (
        "Running on Simulated T4, in float16, at the study's sizes.")
