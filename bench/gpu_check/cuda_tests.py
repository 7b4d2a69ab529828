"""A pytest plugin that runs tests/test_kernels.py's kernels on CUDA, compiled, not interpreted.

The kernel tests build their inputs on the CPU (seeded CPU generators, so the same numbers
everywhere) and compare with chapter 4's reference there. Loaded with
``-p bench.gpu_check.cuda_tests``, this plugin wraps the kernels' entry points so that each call
moves its tensor arguments to the GPU, runs the compiled kernel, copies the cache a store wrote
back into the CPU tensor, and returns the result on the CPU. The tests themselves are unchanged.
``GPU_CHECK_DEVICE`` names the device (``cuda``; ``cpu`` makes every wrapper a plain call, which
is how the dry run exercises this file).
"""
from __future__ import annotations

import functools
import os

import torch

# Entry points, and the position of the argument each one writes into (None: none).
ENTRY_POINTS = {"decode_attention": None, "contiguous_decode_attention": None,
                "extend_attention": None, "paged_attention": None, "triton_store_kv": 2,
                "store_kv": 2}


def on_device(function, device: torch.device, written: int | None, move=None):
    """function, with tensor arguments moved to device and the results brought back.

    ``move`` takes a tensor to the device (``tensor.to(device)`` unless given: a test passes a
    copy, to see the written argument come back without a GPU).
    """
    move = move or (lambda tensor: tensor.to(device))

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        moved = [move(a) if isinstance(a, torch.Tensor) else a for a in args]
        kwmoved = {k: move(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        result = function(*moved, **kwmoved)
        if written is not None and written < len(args) and isinstance(args[written], torch.Tensor) \
                and moved[written] is not args[written]:
            args[written].copy_(moved[written].to(args[written].device))
        return result.to("cpu") if isinstance(result, torch.Tensor) else result
    wrapper.__wrapped_on__ = device
    return wrapper


def install(device: torch.device) -> list[str]:
    """Wrap the kernels' entry points in minipaged.kernels; return the names wrapped."""
    from minipaged import kernels

    wrapped = []
    for name, written in ENTRY_POINTS.items():
        function = getattr(kernels, name, None)
        if function is None or hasattr(function, "__wrapped_on__"):
            continue
        setattr(kernels, name, on_device(function, device, written))
        wrapped.append(name)
    return wrapped


def pytest_configure(config):
    device = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("GPU_CHECK_DEVICE=cuda but torch sees no CUDA device")
    names = install(device)
    print(f"gpu_check: kernels run on {device} ({', '.join(names)}); "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
