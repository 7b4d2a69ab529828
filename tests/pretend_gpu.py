"""Run code on a CPU as if some of its tensors lived on a GPU, and fail where CUDA would.

CI has no GPU, so a line that mixes a CUDA tensor with a CPU tensor (``cpu_tensor[cuda_index]``,
``cuda_a + cpu_b``) never runs there, and such a line stops a T4 reader's notebook. Inside
``PretendGPU()``, tensors marked with ``gpu(t)`` report ``device`` ``meta`` (standing for
``cuda:0``) and ``is_cuda`` true, but keep their CPU data, so the code under test computes real
values. Every torch call is checked as CUDA checks it: the tensors of one call must share a
device, except a 0-dim CPU tensor (a scalar), a CPU index into a GPU tensor, and the calls that
move data (``to``, ``cpu``, ``copy_``, ``as_tensor``). A call given ``device=meta`` makes a GPU
tensor; a result of GPU inputs is a GPU tensor unless the call moved it to the CPU.
"""
from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

GPU = torch.device("meta")  # what a pretend GPU tensor reports; its data stays on the CPU
CPU = torch.device("cpu")
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_, torch.as_tensor,
         torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _is_gpu_device(device) -> bool:
    return device is not None and torch.device(device) == GPU


class PretendGPU(TorchFunctionMode):
    """A torch function mode in which tensors marked by gpu() behave as CUDA tensors."""

    def __init__(self) -> None:
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}

    def gpu(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mark tensor as living on the pretend GPU; returns it."""
        self._marked[id(tensor)] = weakref.ref(tensor)
        return tensor

    def on_gpu(self, value) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        ref = self._marked.get(id(value))
        return ref is not None and ref() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__:  # a new method-wrapper each time: ==, not is
            return GPU if self.on_gpu(args[0]) else func(*args)
        if func == torch.Tensor.is_cuda.__get__:
            return self.on_gpu(args[0])
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        marked = [self.on_gpu(t) for t in leaves]
        target = kwargs.get("device")  # where the call puts its result, None: where its inputs are
        if func is torch.Tensor.to:
            target = next((a for a in args[1:] if isinstance(a, (str, torch.device))), target)
            args = tuple(CPU if isinstance(a, (str, torch.device)) and _is_gpu_device(a) else a
                         for a in args)
        if _is_gpu_device(kwargs.get("device")):
            kwargs["device"] = CPU
        if func not in MOVES and any(marked):
            indices = tree_flatten(args[1])[0] if func in INDEXING and marked[0] else []
            mixed = [t for t, g in zip(leaves, marked) if not g and t.dim() > 0
                     and not any(t is i for i in indices)]  # a CPU index: CUDA moves it itself
            if mixed:
                raise RuntimeError(f"{getattr(func, '__name__', func)} mixes tensors on the GPU "
                                   f"and on the CPU (CPU shapes {[tuple(t.shape) for t in mixed]}),"
                                   " as CUDA would refuse")
        result = func(*args, **kwargs)
        if func in (torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item):
            return result
        if func is torch.Tensor.cpu:
            target = CPU
        on_gpu = _is_gpu_device(target) if target is not None else any(marked)
        if isinstance(result, torch.Tensor) and leaves and result is leaves[0] \
                and on_gpu != marked[0] and func is not torch.Tensor.copy_:
            result = result.clone()  # a move between devices makes a new tensor, as on CUDA
        if on_gpu and func is not torch.Tensor.copy_:
            tree_map(lambda t: self.gpu(t) if isinstance(t, torch.Tensor) else t, result)
        return result
