"""Run a chapter's notebook cell by cell under a memory cap, and record what each cell cost.

On the GPU machine there is no Jupyter and no network. So this runner reads the chapter's
``.ipynb`` twin, turns IPython magics into ``pass``, and executes the code cells in one
namespace in this process, the way a kernel would. Before the first cell it:

* caps the CUDA caching allocator at a T4's usable 14.6 GiB
  (``torch.cuda.set_per_process_memory_fraction``) and makes ``torch.cuda.mem_get_info`` and
  ``get_device_properties().total_memory`` report that cap, so that engines which size their
  cache from the device's memory size it as they would on a T4, and an H200 stands in for a T4;
* records every value a cell glues (``minipaged.runtime.glue``): the numbers the chapter's prose
  would print at this size.

The chapters load "Qwen/Qwen2.5-0.5B-Instruct" at full size. ``fake_hub`` writes a stand-in
into a Hugging Face cache folder: a random model at the real geometry (24 layers, 14/2 heads of
64, vocabulary 151,936) and a byte-level tokenizer with Qwen's chat markers; with
``HF_HUB_OFFLINE=1`` and ``HF_HOME`` pointing at it, transformers and huggingface_hub load it as
if it were the real checkpoint. Its answers are noise; its sizes are the real model's.
"""
from __future__ import annotations

import json
import re
import sys
import time
import traceback
import types
from pathlib import Path

MODEL_ID = "Qwen/Qwen2.5-0.5B-Instruct"
REVISION = "0" * 40  # the stand-in's commit hash in the cache
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                 "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|im_start|>assistant\\n' }}{% endif %}")
MAGIC = re.compile(r"^(\s*)[%!]")
CELL_FIELDS = ["chapter", "cell", "status", "seconds", "peak_allocated_bytes",
               "peak_reserved_bytes", "allocated_after_bytes", "pinned_host_bytes",
               "memory_cap_bytes", "first_line", "error"]
GLUE_FIELDS = ["chapter", "cell", "name", "value"]


# ---- the notebook ----

def code_cells(notebook: Path) -> list[str]:
    """The source of every code cell of an .ipynb file, in order."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    sources = [c["source"] for c in cells if c["cell_type"] == "code"]
    return [s if isinstance(s, str) else "".join(s) for s in sources]


def strip_magics(source: str) -> str:
    """Python for a cell: each line magic or shell escape becomes ``pass``; a cell magic, empty."""
    if source.lstrip().startswith("%%"):
        return ""
    return "\n".join(MAGIC.sub(r"\1pass  # ", line) if MAGIC.match(line) else line
                     for line in source.splitlines())


def ipython_stand_in() -> bool:
    """Make ``from IPython.display import Markdown, display`` work without IPython; True if made."""
    try:
        import IPython.display  # noqa: F401
        return False
    except ImportError:
        pass

    class Shown:
        def __init__(self, data=None, *args, **kwargs):
            self.data = data

        def __repr__(self) -> str:
            return str(self.data)

    display_module = types.ModuleType("IPython.display")
    for name in ("Markdown", "HTML", "Image", "SVG", "Latex", "Math", "JSON"):
        setattr(display_module, name, type(name, (Shown,), {}))
    display_module.display = lambda *objects, **kwargs: print(*objects)
    package = types.ModuleType("IPython")
    package.display = display_module
    package.get_ipython = lambda: None
    sys.modules.update({"IPython": package, "IPython.display": display_module})
    return True


# ---- memory: an H200 standing in for a T4 ----

def cap_memory(cap_bytes: int, cuda=None) -> dict:
    """Cap CUDA memory at cap_bytes and make the device report cap_bytes as its size.

    ``cuda`` is ``torch.cuda`` (a test passes a stand-in with the same five functions).
    """
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available():
        return {"memory_cap": "none (no CUDA device)"}
    real_mem_get_info, real_properties = cuda.mem_get_info, cuda.get_device_properties
    total = real_properties(0).total_memory
    fraction = min(1.0, cap_bytes / total)
    cuda.set_per_process_memory_fraction(fraction, 0)

    def mem_get_info(device=None):
        free, _ = real_mem_get_info(device)
        return min(free, max(0, cap_bytes - cuda.memory_reserved(device))), cap_bytes

    class CappedProperties:
        def __init__(self, properties):
            self._properties = properties

        def __getattr__(self, name):
            return cap_bytes if name == "total_memory" else getattr(self._properties, name)

    cuda.mem_get_info = mem_get_info
    cuda.get_device_properties = lambda device=None: CappedProperties(real_properties(device))
    return {"memory_cap": f"{cap_bytes} bytes = {fraction:.4f} of {total}"}


def _memory(reset: bool = False) -> dict:
    """Peak and current CUDA memory since the last reset, and the pinned host memory torch holds
    now (zeros without CUDA; pinned "" where this torch does not report it)."""
    import torch

    if not torch.cuda.is_available():
        return {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0, "allocated_after_bytes": 0,
                "pinned_host_bytes": 0}
    from minipaged.sizing import pinned_host_bytes

    torch.cuda.synchronize()
    pinned = pinned_host_bytes()
    numbers = {"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
               "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
               "allocated_after_bytes": torch.cuda.memory_allocated(),
               "pinned_host_bytes": "" if pinned is None else pinned}
    if reset:
        torch.cuda.reset_peak_memory_stats()
    return numbers


# ---- one chapter ----

def run_chapter(notebook: Path, cells_writer, glue_writer, cap_bytes: int | None,
                max_cells: int | None = None, log=print) -> dict:
    """Execute the chapter's code cells in order; one row per cell; never stops at an error."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import minipaged.runtime

    chapter = Path(notebook).stem
    ipython_stand_in()
    cap_note = cap_memory(cap_bytes) if cap_bytes else {"memory_cap": "none"}
    log(f"{chapter}: {cap_note['memory_cap']}")
    current = {"cell": -1}
    real_glue = minipaged.runtime.glue

    def glue(name, value, display=False):
        glue_writer.write({"chapter": chapter, "cell": current["cell"], "name": name,
                           "value": repr(getattr(value, "data", value))})
        return real_glue(name, value, display)

    minipaged.runtime.glue = glue
    namespace = {"__name__": "__main__", "display": print}
    summary = {"chapter": chapter, "cells": 0, "errors": 0, "first_error": "",
               "peak_reserved_bytes": 0}
    os.chdir(Path(notebook).parent)  # relative paths in a chapter are relative to its folder
    sources = code_cells(notebook)[:max_cells]
    for index, source in enumerate(sources):
        current["cell"] = index
        _memory(reset=True)
        start, error = time.perf_counter(), ""
        try:
            exec(compile(strip_magics(source), f"<{chapter} cell {index}>", "exec"), namespace)
        except BaseException as caught:  # noqa: B036 - a cell may call sys.exit or raise anything
            if isinstance(caught, KeyboardInterrupt):
                raise
            error = "".join(traceback.format_exception_only(type(caught), caught)).strip()
            log(traceback.format_exc(limit=-3))
        seconds = time.perf_counter() - start
        memory = _memory()
        plt.close("all")
        first = next((line for line in source.splitlines() if line.strip()), "")
        cells_writer.write({"chapter": chapter, "cell": index, "status": "error" if error else "ok",
                            "seconds": seconds, **memory, "memory_cap_bytes": cap_bytes or "",
                            "first_line": first[:100], "error": error[-500:]})
        summary["cells"] += 1
        summary["peak_reserved_bytes"] = max(summary["peak_reserved_bytes"],
                                             memory["peak_reserved_bytes"])
        if error:
            summary["errors"] += 1
            summary["first_error"] = summary["first_error"] or f"cell {index}: {error[-300:]}"
        log(f"{chapter} cell {index:>2}: {'ERROR' if error else 'ok':5} {seconds:7.2f} s, "
            f"peak reserved {memory['peak_reserved_bytes'] / 2**30:6.2f} GiB")
    minipaged.runtime.glue = real_glue
    return summary


# ---- the stand-in checkpoint ----

def byte_level_tokenizer(special_ids: dict[str, int]):
    """A byte-level BPE tokenizer with no merges (one token per byte) and Qwen's markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    vocab.update(special_ids)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(special_ids))
    return tokenizer


def real_geometry(small: bool = False):
    """Qwen2.5-0.5B-Instruct's shape (a two-layer toy with a 512-token vocabulary if small)."""
    from minipaged.model import ModelConfig

    if small:
        return ModelConfig.small(num_layers=2, eos_token_id=511)
    return ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=32768, rope_theta=1_000_000.0,
                       tie_word_embeddings=True, eos_token_id=151645)


def stand_in_snapshot() -> Path | None:
    """The stand-in's folder in $HF_HOME's cache, if the hub stage wrote it."""
    import os

    home = os.environ.get("HF_HOME")
    repo = Path(home or "/nonexistent") / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    return snapshot if (snapshot / "model.safetensors").is_file() else None


def fake_hub(home: Path, config, dtype, device) -> Path:
    """Write MODEL_ID into the Hugging Face cache under home: random weights, real shape."""
    from minipaged.huggingface import save_pretrained
    from minipaged.model import random_model

    repo = Path(home) / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    save_pretrained(random_model(config, seed=0, dtype=dtype, device=device), snapshot)
    eos = config.eos_token_id
    special_ids = {token: eos - 2 + i for i, token in enumerate(SPECIAL_TOKENS)}
    byte_level_tokenizer(special_ids).save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE,
        "model_max_length": config.max_position_embeddings}, indent=2))
    (snapshot / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": eos - 2, "do_sample": False}))
    return snapshot
