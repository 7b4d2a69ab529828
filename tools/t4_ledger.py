"""What each chapter keeps on the GPU at full size, added up on a CPU: the T4 ledger.

A chapter at full size (``runtime.pick(full=...)``, the real Qwen2.5-0.5B-Instruct in fp16) must
fit a T4's 14.6 GiB with everything it keeps alive at once. This script checks that without a
GPU. It reads each chapter's code cells (the ``.ipynb`` twins; of an exported cell, the data it
defines is read from the package and its plain functions are walked when called) and walks them
in order with a small interpreter (tools/cell_walker.py) taught what the book's constructors put
on the device and what ``runtime.pick`` returns at full size:

* ``load_model(...)``, ``random_model(...)``, transformers' ``from_pretrained(...).to(device)``:
  weights, counted from the model's real configuration (Qwen2.5-0.5B's is read from chapter 6's
  ``QWEN2_5_0_5B_CONFIG`` cell), at the dtype's width;
* ``LLM(...)``, chapter 7's ``LLMFrontEnd(...)`` and ``LLMEngine(...)`` on the device: their KV
  cache, sized by the engine's own ``num_cache_blocks`` against the simulated card's free memory
  (so an engine left at the default ``gpu_memory_utilization`` takes what the real one would),
  its model's weights unless shared, and the activation peak of one step at
  ``max_num_batched_tokens`` (``activation_bytes``);
* ``KVCache(...)`` and ``torch.empty/zeros`` on the device: their bytes.

Everything else the chapters do evaluates to "unknown" and allocates nothing. An object lives as
long as a name, a container, an engine or a running statement refers to it, as in Python; ``del``
and rebinding release it. At every allocation the ledger adds what is alive, the CUDA context
(chapter 1's ``T4_CONTEXT_BYTES``) and the largest activation peak of a live engine, and compares
the sum with chapter 1's ``T4_TOTAL_BYTES``. It also lists every engine on the device that was
not given a size (``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or
``gpu_memory_utilization``), and every engine construction in a chapter that it never reached.

Beside the GPU it keeps the host's side of a Colab T4, a VM of ``COLAB_HOST_BYTES``: a swapping
engine's host pool (pageable, ``swap_space`` or ``num_cpu_blocks`` after the cap, as
``SwapScheduler.blocks_for_swap_space`` sizes it) and its two pinned staging buffers, booked at
their most (``swap_host_bytes``). Pinned memory outlives its engine in torch's cache until a
``release_memory()`` (chapter 7's, which every chapter's ``release()`` calls) empties it, and the
ledger keeps it so; each chapter's peaks, and what stayed pinned after each release, are in its
``ChapterLedger``. The process itself (Python, torch, the CUDA libraries) is not counted.

On the way it counts the model work each chapter asks for (``Work``: forward passes and prompt
tokens), from which bench/t4_estimate.py estimates a chapter's time on a T4.

``python tools/t4_ledger.py`` prints the table; ``tests/test_t4_ledger.py`` asserts it.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tools.cell_walker import (
    NOT_HANDLED,
    UNKNOWN,
    Break,
    Continue,
    Namespace,
    Native,
    Return,
    Unknown,
    Walker,
    builtins,
)

ROOT = Path(__file__).resolve().parent.parent
ENGINE_CALLS = {"LLM", "LLMFrontEnd", "LLMEngine"}
COLAB_HOST_BYTES = 12_700_000_000  # a Colab T4 runtime's VM: about 12.7 GB of memory


@dataclass(eq=False)
class Allocation:
    """Bytes some object holds, on the device or not."""

    what: str
    nbytes: int
    on_device: bool
    model: Allocation | None = None  # an engine's weights
    activation: int = 0  # an engine's peak for one step
    options: dict = field(default_factory=dict)  # an engine's LLM or LLMFrontEnd options
    config: object = None  # a model's ModelConfig
    dtype_bytes: int = 2
    host_bytes: int = 0  # pageable host memory (a swapping engine's host pool)
    pinned_bytes: int = 0  # pinned host memory at most (its staging buffers)


@dataclass
class DType:
    name: str
    nbytes: int


@dataclass
class Device:
    type: str


@dataclass
class Shaped:
    """A host tensor of random or given numbers whose shape is all the ledger keeps: enough for
    len(prompt) and prompt lengths, which size the caches of the chapters."""

    shape: tuple

    def tolist(self):
        def zeros(shape):
            return [0] * shape[0] if len(shape) == 1 else [zeros(shape[1:]) for _ in
                                                           range(shape[0])]
        return zeros(self.shape) if self.shape else 0

    def __len__(self) -> int:
        return self.shape[0]


def random_tensor(ledger, args, kwargs, node):
    """torch.randint(low, high, size) or (high, size), torch.randperm(n), torch.tensor(list)."""
    name = Ledger.call_name(node)
    if name == "randperm" and isinstance(args[0], int):
        return Shaped((args[0],))
    if name == "tensor" and isinstance(args[0], list):
        return Shaped((len(args[0]),))
    size = kwargs.get("size", args[-1] if args else None)
    if isinstance(size, (tuple, list)) and all(isinstance(s, int) for s in size):
        return Shaped(tuple(size))
    return UNKNOWN


@dataclass
class Params:
    """SamplingParams as the ledger needs them: n and max_tokens (vLLM's default 16)."""

    options: dict

    @property
    def n(self) -> int:
        n = self.options.get("n", 1)
        return n if isinstance(n, int) else 1

    @property
    def max_tokens(self):
        return self.options.get("max_tokens", 16)


@dataclass
class Event:
    """One allocation and what was alive with it."""

    chapter: str
    cell: int
    line: int
    what: str
    live_bytes: int
    activation: int
    total: int


@dataclass
class ChapterLedger:
    chapter: str
    peak: Event | None = None
    events: list[Event] = field(default_factory=list)
    over: list[Event] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    unsized: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # device allocations of unknown size
    work: Work = field(default_factory=lambda: Work())
    host_peak: int = 0  # host pools and pinned memory alive (or cached) at once, at most
    pinned_peak: int = 0  # of which pinned
    pinned_after_release: list[int] = field(default_factory=list)  # after each release_memory()
    host_over: list[str] = field(default_factory=list)  # more than the VM holds


@dataclass
class Work:
    """The model work a chapter asks of the GPU at full size, as the ledger counts it: steps
    (forward passes), prompt tokens computed, tokens generated; requests of unknown length."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    unknown_requests: int = 0
    weight_bytes: int = 0  # the largest model the chapter runs, for the bandwidth floor
    preemption_steps: int = 0  # of steps: those added because the pool preempted
    recomputed_tokens: int = 0  # tokens computed again after a preemption (a prefill's FLOPs)


def scheduled_work(requests: list[tuple[int, int]], num_blocks: int, block_size: int,
                   max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                   preemption_mode: str | None = None) -> tuple[int, int, int]:
    """Run the book's own scheduler (chapter 7's, or chapter 11's swapping one) over requests
    of (prompt length, answer length) on a pool of num_blocks, every sampled token a dummy and
    no model: (steps, tokens computed, preemptions), preemption's extra steps and recomputed
    tokens included. Prefix caching is off (the ledger's prompts are lengths, not tokens)."""
    from minipaged.blocks import BlockPool
    from minipaged.llm import SCHEDULER_CLASSES
    from minipaged.sampling import SamplingParams
    from minipaged.scheduler import KVCacheManager, Request, needs_sample

    mode = preemption_mode or option({}, "preemption_mode")  # None: the LLM's default
    scheduler = SCHEDULER_CLASSES[mode](
        KVCacheManager(BlockPool(num_blocks, block_size)), max_num_batched_tokens, max_num_seqs,
        max_model_len)
    for number, (prompt, answer) in enumerate(requests):
        scheduler.add_request(Request(str(number), [0] * prompt, SamplingParams(
            temperature=0, max_tokens=answer, ignore_eos=True)))
    steps = computed = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if not out.scheduled_requests:
            raise ValueError("the scheduler could schedule nothing although requests wait")
        counts = out.num_scheduled_tokens
        steps, computed = steps + 1, computed + out.total_num_scheduled_tokens
        scheduler.update_from_output(out, {r.request_id: 0 for r in out.scheduled_requests
                                           if needs_sample(r, counts[r.request_id])})
    return steps, computed, scheduler.num_preemptions


def swap_host_bytes(num_cpu_blocks: int, block_bytes: int, num_layers: int) -> tuple[int, int]:
    """A swapping engine's host memory at most: (its pool, pageable, of num_cpu_blocks blocks;
    its two staging buffers, pinned at the allocator's power of two, each as large as one layer
    of the whole pool, for a step that moves every block). While the pair grows, the pair
    before it (half as large at most) may wait in torch's cache until its copies are over."""
    from minipaged.swap import pinned_bytes

    return num_cpu_blocks * block_bytes, 2 * pinned_bytes(num_cpu_blocks * block_bytes
                                                          // num_layers)


def swap_pool_blocks(options: dict, block_bytes: int, block_size: int, longest: int,
                     max_num_seqs: int) -> int:
    """The host pool SwapScheduler.blocks_for_swap_space gives: swap_space (GiB, EngineArgs') in
    whole blocks, capped at what max_num_seqs sequences of longest can fill."""
    from minipaged.checks import cdiv
    from minipaged.memory import GiB

    swap_space = option(options, "swap_space")
    swap_space = swap_space if isinstance(swap_space, (int, float)) else option({}, "swap_space")
    return min(int(swap_space * GiB) // block_bytes, max_num_seqs * cdiv(longest, block_size))


def option(options: dict, name: str):
    """options[name], else the package LLM's default for it: read from its one owner,
    minipaged.llm.EngineArgs (chapters 7 and 12), never restated here."""
    if name in options:
        return options[name]
    from minipaged.llm import EngineArgs

    return {field.name: field for field in dataclasses.fields(EngineArgs)}[name].default


def preemption_mode(options: dict) -> str:
    """How an engine built with these options preempts: the package LLM's preemption_mode, or
    chapter 11's SwapScheduler handed to chapter 7's LLMFrontEnd as scheduler_cls."""
    swapping = getattr(options.get("scheduler_cls"), "__name__", "") == "SwapScheduler"
    return "swap" if swapping else option(options, "preemption_mode")


def activation_bytes(config, num_tokens: int, num_rows: int, dtype_bytes: int) -> int:
    """An upper bound on one step's transient memory: for each of num_tokens tokens, the
    residual, normed and attention-output rows (4 x hidden), q, k, v, the MLP's gate, up and
    activated rows (3 x intermediate) in the model's dtype, held together in one layer; and the
    logits of num_rows sampled rows over the vocabulary in fp32, twice (the logits and the
    engine's copy of the sampled rows, which chapter 7's profile of a full step holds too)."""
    q_kv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_token = 4 * config.hidden_size + q_kv + 3 * config.intermediate_size
    return num_tokens * per_token * dtype_bytes + 2 * num_rows * config.vocab_size * 4


def model_bytes(config, dtype_bytes: int) -> int:
    """Parameter bytes of the book's Qwen2 at this config (a tied head counted once)."""
    import torch

    from minipaged.model import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique) * dtype_bytes


def qwen_config():
    """Qwen2.5-0.5B-Instruct's ModelConfig, from the dict chapter 6 writes out."""
    from minipaged.model import ModelConfig

    source = (ROOT / "chapters" / "06_model.md").read_text()
    tree = ast.parse(re.search(r"^QWEN2_5_0_5B_CONFIG = \{.*?^\}", source, re.S | re.M).group())
    return ModelConfig.from_hf_config(ast.literal_eval(tree.body[0].value))


EXPORT = re.compile(r"^#\|[ \t]*(export|default_exp)\b[ \t]*(\S*)", re.M)


def chapter_cells(notebook: Path) -> list[tuple[str, str | None]]:
    """Each code cell of an .ipynb twin, with the module it exports to (None: not exported)."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    found, default = [], None
    for source in ("".join(c["source"]) for c in cells if c["cell_type"] == "code"):
        module = None
        for kind, name in EXPORT.findall(source):
            if kind == "default_exp":
                default = name
            else:
                module = name or default
        found.append((source, module))
    return found


class Generator:
    """numpy's default_rng as the ledger needs it: integers(...) of a known size."""

    def integers(self, low, high=None, size=None):
        if isinstance(size, int):
            return Shaped((size,))
        if isinstance(size, tuple) and all(isinstance(n, int) for n in size):
            return Shaped(size)
        return 0 if size is None else UNKNOWN


def importable(module: str, name: str):
    """A minipaged module's value by name when it is data (a number, a shape, a dict), else
    Unknown: the ledger follows data into the chapters, and models functions itself."""
    if not module.startswith("minipaged"):
        return UNKNOWN
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return UNKNOWN
    plain = (int, float, str, bool, dict, list, tuple)
    if isinstance(value, plain) or (dataclasses.is_dataclass(value)
                                    and not isinstance(value, type)):
        return value
    return UNKNOWN


class Ledger(Walker):
    """Walks one chapter's cells (tools/cell_walker.py); see the module's docstring."""

    def __init__(self, chapter: str, total_bytes: int, context_bytes: int) -> None:
        import minipaged.frontend
        import minipaged.model
        import minipaged.sizing

        self.frontend_module, self.ModelConfig = minipaged.frontend, minipaged.model.ModelConfig
        self.sizing_module = minipaged.sizing
        # the front end's own default (one owner: chapter 7's FrontEndArgs)
        self.default_utilization = minipaged.frontend.FrontEndArgs.gpu_memory_utilization
        self.result = ChapterLedger(chapter)
        self.total_bytes, self.context_bytes = total_bytes, context_bytes
        self.qwen = qwen_config()
        super().__init__(self.globals())
        self.errors = self.result.errors
        self.reached: set[int] = set()  # the engine constructions evaluated
        self.sites: dict[int, str] = {}  # every engine construction outside a lambda
        self.pinned_held: list[Allocation] = []  # engines whose pinned blocks torch still holds

    # ---- the world the chapters see at full size ----

    def globals(self) -> dict:
        cuda, fp16, fp32 = Device("cuda"), DType("float16", 2), DType("float32", 4)
        torch = Namespace(
            float16=fp16, float32=fp32, bfloat16=DType("bfloat16", 2), half=fp16, float=fp32,
            int8=DType("int8", 1), uint8=DType("uint8", 1), int32=DType("int32", 4),
            int64=DType("int64", 8), long=DType("int64", 8), bool=DType("bool", 1),
            device=Native(lambda led, a, k, n: Device(str(a[0]).split(":")[0]) if a and
                          isinstance(a[0], str) else (a[0] if a else UNKNOWN)),
            empty=Native(self.tensor), zeros=Native(self.tensor), ones=Native(self.tensor),
            randint=Native(random_tensor), randperm=Native(random_tensor),
            tensor=Native(random_tensor),
            cuda=Namespace(is_available=Native(lambda *_: True),
                           empty_cache=Native(lambda *_: None),
                           synchronize=Native(lambda *_: None)))
        self.numpy = Namespace(random=Namespace(default_rng=Native(lambda *_: Generator())))
        runtime = Namespace(full=True, device=cuda, dtype=fp16, scale="full",
                            gpu_name="Tesla T4",
                            pick=Native(lambda led, a, k, n: k["full"] if "full" in k else a[1]))
        detect = Native(lambda *_: runtime)
        native = {
            "SamplingParams": Native(lambda led, a, k, n: Params(k)),
            "LLM": Native(self.llm), "LLMFrontEnd": Native(self.front_end),
            "LLMEngine": Native(self.llm_engine),
            "KVCache": Native(self.kv_cache), "load_model": Native(self.load_model),
            "random_model": Native(self.random_model),
            "ModelConfig": Namespace(small=Native(lambda led, a, k, n:
                                                  self.ModelConfig.small(*a, **k)),
                                     from_hf_config=Native(lambda led, a, k, n:
                                                           self.ModelConfig.from_hf_config(*a))),
            "to_transformers": Native(self.to_transformers),
            "Runtime": Namespace(detect=detect), "runtime": runtime,
            "torch": torch, "math": math, "gc": Namespace(collect=Native(lambda *_: 0)),
        }
        return builtins() | native

    # ---- allocations ----

    def live(self) -> list[Allocation]:
        """Every allocation reachable from a frame or a running statement's temporaries."""
        seen, found, stack = set(), [], [*self.frames, *self.temps]
        while stack:
            value = stack.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, Allocation):
                found.append(value)
                if value.model is not None:
                    stack.append(value.model)
            elif isinstance(value, dict):
                stack.extend(value.keys())
                stack.extend(value.values())
            elif isinstance(value, (list, tuple, set)):
                stack.extend(value)
        return found

    def device_bytes(self) -> tuple[int, int]:
        """(bytes alive on the device with the context, largest activation of a live engine)."""
        alive = [a for a in self.live() if a.on_device]
        return (self.context_bytes + sum(a.nbytes for a in alive),
                max([a.activation for a in alive], default=0))

    def host_held(self) -> tuple[int, int]:
        """(host bytes held: live engines' pools and every pinned block, live or cached; of
        which pinned)."""
        pinned = sum(a.pinned_bytes for a in self.pinned_held)
        return sum(a.host_bytes for a in self.live()) + pinned, pinned

    def note_host(self, what: str, peak: bool = True) -> None:
        """Record the host's side: its peaks when a swapping engine generates (its pool and
        staging are taken at the first swap-out), and a VM overflowed whenever one is sized
        (the scheduler's check against the host's available memory)."""
        held, pinned = self.host_held()
        result = self.result
        if peak:
            result.host_peak = max(result.host_peak, held)
            result.pinned_peak = max(result.pinned_peak, pinned)
        if held > COLAB_HOST_BYTES:
            result.host_over.append(f"cell {self.cell} line {self.line}: {what}: {held:,} bytes "
                                    f"of host memory held, {pinned:,} of them pinned")

    def release_memory(self, ledger, args, kwargs, node) -> None:
        """Chapter 7's release_memory: torch's cache lets go of the dead engines' pinned blocks."""
        live = self.live()
        self.pinned_held = [a for a in self.pinned_held if any(a is b for b in live)]
        self.result.pinned_after_release.append(self.host_held()[1])

    def set_num_cpu_blocks(self, engine: Allocation, args, kwargs) -> None:
        """SwapScheduler.set_num_cpu_blocks on a swapping engine: its host pool resized."""
        count = args[0] if args else kwargs.get("num_cpu_blocks")
        if isinstance(count, int) and count > 0:
            options = engine.options
            engine.host_bytes, engine.pinned_bytes = swap_host_bytes(
                count, options["block_bytes"], options["num_layers"])
            self.note_host(f"{engine.what}: {count:,} host blocks", peak=False)

    def allocate(self, allocation: Allocation) -> Allocation:
        """Book a new allocation: record what is alive with it, then keep it as a temporary."""
        if allocation.on_device:
            held, activation = self.device_bytes()
            if allocation.model is not None and allocation.model not in self.live():
                held += allocation.model.nbytes if allocation.model.on_device else 0
            activation = max(activation, allocation.activation)
            event = Event(self.result.chapter, self.cell, self.line, allocation.what,
                          held + allocation.nbytes, activation,
                          held + allocation.nbytes + activation)
            self.result.events.append(event)
            if self.result.peak is None or event.total > self.result.peak.total:
                self.result.peak = event
            if event.total > self.total_bytes:
                self.result.over.append(event)
        self.temps[-1].append(allocation)
        if allocation.pinned_bytes:
            self.pinned_held.append(allocation)
        if allocation.host_bytes or allocation.pinned_bytes:
            self.note_host(allocation.what, peak=False)
        return allocation

    def on_device(self, device) -> bool:
        if device is None or device is UNKNOWN:
            return True  # the default device at full size is the GPU
        if isinstance(device, Device):
            return device.type == "cuda"
        return isinstance(device, str) and device.startswith("cuda")

    @staticmethod
    def dtype_bytes(dtype, default: int = 2) -> int:
        if isinstance(dtype, DType):
            return dtype.nbytes
        if isinstance(dtype, str):
            return {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, default)
        return default

    def weights(self, config, dtype, device, what: str) -> Allocation:
        size = self.dtype_bytes(dtype, 4)
        return self.allocate(Allocation(what, model_bytes(config, size), self.on_device(device),
                                        config=config, dtype_bytes=size))

    def tensor(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        if not shape or not all(isinstance(s, int) for s in shape):
            if self.on_device(kwargs.get("device", Device("cpu"))):
                self.result.unknown.append(f"cell {self.cell} line {self.line}: tensor{shape}")
            return UNKNOWN
        size = self.dtype_bytes(kwargs.get("dtype"), 4) * math.prod(shape)
        return self.allocate(Allocation("tensor", size, self.on_device(kwargs.get("device",
                                                                                   Device("cpu")))))

    def kv_cache(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        names = ["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype",
                 "device"]
        given = dict(zip(names, args)) | kwargs
        numbers = [given.get(n) for n in names[:5]]
        if not all(isinstance(n, int) for n in numbers):
            if self.on_device(given.get("device", Device("cpu"))):
                self.result.unknown.append(f"cell {self.cell} line {self.line}: KVCache{numbers}")
            return UNKNOWN
        size = math.prod(numbers) * 2 * self.dtype_bytes(given.get("dtype"), 4)
        return self.allocate(Allocation("KVCache", size,
                                        self.on_device(given.get("device", Device("cpu")))))

    def load_model(self, ledger, args, kwargs, node) -> Allocation:
        return self.weights(self.qwen, kwargs.get("dtype", DType("float32", 4)),
                            kwargs.get("device", Device("cpu")), f"load_model({args[0]!r})")

    def random_model(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        config = args[0] if args else kwargs.get("config")
        if not isinstance(config, self.ModelConfig):
            return UNKNOWN
        return self.weights(config, kwargs.get("dtype", DType("float32", 4)),
                            kwargs.get("device", Device("cpu")), "random_model")

    def from_pretrained(self, ledger, args, kwargs, node) -> Allocation:
        return self.weights(self.qwen, DType("float32", 4), Device("cpu"),
                            f"from_pretrained({args[0]!r})")

    def to_transformers(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        model = args[0] if args else UNKNOWN
        if not isinstance(model, Allocation) or model.config is None:
            return UNKNOWN
        return self.allocate(Allocation("to_transformers", model.nbytes, model.on_device,
                                        config=model.config, dtype_bytes=model.dtype_bytes))

    def model_of(self, model, kwargs) -> Allocation | Unknown:
        """The weights an engine computes with: given, or built from a name."""
        if isinstance(model, Allocation):
            return model
        dtype = kwargs.get("dtype")
        dtype = DType("float16", 2) if dtype in (None, "auto") else dtype
        device = kwargs.get("device")
        if model == "random":
            config = self.frontend_module.PRESETS["random"]()
            return self.weights(config, dtype, device, "LLM(model='random')")
        if isinstance(model, str):
            return self.weights(self.qwen, dtype, device, f"LLM(model={model!r})")
        return UNKNOWN

    def engine(self, model: Allocation, options: dict, what: str,
               num_blocks=None) -> Allocation | Unknown:
        """Size an engine as LLM does, on the simulated card, and book its cache."""
        if not model.on_device:
            return self.allocate(Allocation(what, 0, False, model=model))
        config, block_size = model.config, option(options, "block_size")
        limit = options.get("max_model_len")
        longest = min(limit or config.max_position_embeddings, config.max_position_embeddings)
        max_num_seqs = option(options, "max_num_seqs")
        tokens = option(options, "max_num_batched_tokens")
        numbers = [block_size, longest, max_num_seqs, tokens]
        if not all(isinstance(n, int) for n in numbers):
            self.result.errors.append(f"line {self.line}: {what}: sizes unknown {numbers}")
            return UNKNOWN
        activation = activation_bytes(config, tokens, min(max_num_seqs, tokens),
                                      model.dtype_bytes)
        block_bytes = config.model_shape(model.dtype_bytes).kv_bytes_per_token * block_size
        if num_blocks is None and not any(k in options for k in (
                "num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")):
            self.result.unsized.append(f"line {self.line}: {what}")
        held, _ = self.device_bytes()
        if model not in self.live():
            held += model.nbytes
        free = self.total_bytes - held
        try:
            if num_blocks is None:
                num_blocks = options.get("num_gpu_blocks_override")
            if num_blocks is None:
                num_blocks = self.sizing_module.num_cache_blocks(
                    block_bytes, block_size, longest, max_num_seqs,
                    options.get("gpu_memory_utilization", self.default_utilization),
                    options.get("kv_cache_memory_bytes"), (free, self.total_bytes),
                    lambda: activation)
            if not isinstance(num_blocks, int):
                raise ValueError(f"a number of blocks the ledger cannot follow: {num_blocks}")
            if num_blocks < math.ceil(longest / block_size):
                raise ValueError(f"{num_blocks} blocks cannot hold one sequence of {longest}")
        except ValueError as error:
            self.result.refused.append(f"line {self.line}: {what}: {error}")
            return UNKNOWN
        host = pinned = 0
        if preemption_mode(options) == "swap":  # its host pool, sized as the scheduler does
            host, pinned = swap_host_bytes(
                swap_pool_blocks(options, block_bytes, block_size, longest, max_num_seqs),
                block_bytes, config.num_hidden_layers)
        return self.allocate(Allocation(f"{what}: {num_blocks:,} blocks",
                                        num_blocks * block_bytes, True, model=model,
                                        activation=activation, host_bytes=host,
                                        pinned_bytes=pinned,
                                        options=dict(max_num_seqs=max_num_seqs,
                                                     max_num_batched_tokens=tokens,
                                                     num_blocks=num_blocks, block_size=block_size,
                                                     max_model_len=longest,
                                                     preemption_mode=preemption_mode(options),
                                                     block_bytes=block_bytes,
                                                     num_layers=config.num_hidden_layers)))

    # ---- work ----

    def generate(self, engine: Allocation, args, kwargs) -> Unknown:
        """Count the steps and tokens of llm.generate / llm.stream: prompts prefilled in steps
        of max_num_batched_tokens, then one step per generated token for each batch of
        max_num_seqs requests. When the pool cannot hold every request at its full length at once,
        a preemption may happen: then the steps and the recomputed tokens are those of the book's
        scheduler run over these lengths (scheduled_work)."""
        prompts = args[0] if args else kwargs.get("prompts", UNKNOWN)
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params", Params({}))
        prompts = [prompts] if isinstance(prompts, (dict, str)) else prompts
        if not isinstance(prompts, (list, tuple)):
            self.result.work.unknown_requests += 1
            return UNKNOWN
        params = params if isinstance(params, list) else [params] * len(prompts)
        work, options = self.result.work, engine.options
        lengths, answers, requests = [], [], []
        for prompt, param in zip(prompts, params):
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            n, max_tokens = getattr(param, "n", 1), getattr(param, "max_tokens", 16)
            if not isinstance(ids, list) or not isinstance(max_tokens, int):
                work.unknown_requests += 1
                continue
            lengths.append(len(ids))
            answers += [max_tokens] * (n if isinstance(n, int) else 1)
            requests += [(len(ids), max_tokens)] * (n if isinstance(n, int) else 1)
        seqs, budget = option(options, "max_num_seqs"), option(options, "max_num_batched_tokens")
        batches = [answers[i:i + seqs] for i in range(0, len(answers), seqs)]
        steps = math.ceil(sum(lengths) / budget) + sum(max(b) for b in batches)
        block_size, num_blocks = option(options, "block_size"), options.get("num_blocks")
        wanted = sum(math.ceil(min(p + a, options.get("max_model_len", p + a)) / block_size)
                     for p, a in requests)
        if isinstance(num_blocks, int) and wanted > num_blocks:  # the pool may preempt
            simulated, computed, _ = scheduled_work(
                requests, num_blocks, block_size, options["max_model_len"], seqs, budget,
                options["preemption_mode"])
            work.preemption_steps += max(0, simulated - steps)
            work.recomputed_tokens += max(0, computed - sum(p + a - 1 for p, a in requests))
            steps = simulated
        if engine.host_bytes or engine.pinned_bytes:  # the swaps take the host pool
            self.note_host(f"{engine.what} generates")
        work.steps += steps
        work.prompt_tokens += sum(lengths)
        work.generated_tokens += sum(answers)
        if engine.model is not None:
            work.weight_bytes = max(work.weight_bytes, engine.model.nbytes)
        return UNKNOWN

    def forward(self, model: Allocation, steps: int) -> Unknown:
        """A model called directly, or transformers' generate: steps forward passes."""
        self.result.work.steps += steps
        self.result.work.weight_bytes = max(self.result.work.weight_bytes, model.nbytes)
        return UNKNOWN

    def llm(self, ledger, args, kwargs, node, what: str = "LLM") -> Allocation | Unknown:
        model = self.model_of(args[0] if args else kwargs.get("model", "random"), kwargs)
        if not isinstance(model, Allocation) or model.config is None:
            self.result.errors.append(f"line {self.line}: {what} of an unknown model")
            return UNKNOWN
        return self.engine(model, kwargs, what)

    def front_end(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        """Chapter 7's LLMFrontEnd: sized as the package's LLM, which subclasses it."""
        return self.llm(ledger, args, kwargs, node, "LLMFrontEnd")

    def llm_engine(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        names = ["model", "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens"]
        given = dict(zip(names, args)) | kwargs
        model = given.get("model")
        if not isinstance(model, Allocation) or model.config is None:
            self.result.errors.append(f"line {self.line}: LLMEngine of an unknown model")
            return UNKNOWN
        return self.engine(model, given, "LLMEngine", num_blocks=given.get("num_gpu_blocks"))

    def run_cell(self, source: str) -> None:
        tree = self.parse(source)
        if tree is None:
            return
        for node in ast.walk(tree):  # the engine constructions this cell holds
            if isinstance(node, ast.Call) and self.call_name(node) in ENGINE_CALLS \
                    and not self.in_lambda(tree, node):
                self.sites[id(node)] = f"cell {self.cell} line {node.lineno}"
        self.block(tree.body)

    def run_exported(self, source: str, module: str) -> None:
        """The package's code in a chapter: its data is read from the module it writes, its
        plain functions are walked like the chapter's own; the constructors stay modelled."""
        modelled = set(self.globals())
        tree = ast.parse(source)
        for node in tree.body:
            if isinstance(node, ast.Assign):
                for name in [t.id for t in node.targets if isinstance(t, ast.Name)]:
                    if name not in modelled:
                        self.frames[0][name] = importable(f"minipaged.{module}", name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.statement(node)
            elif isinstance(node, ast.ClassDef) and node.name not in modelled:
                # the class itself, for what names it (isinstance, scheduler_cls=...); calls to
                # it stay unknown
                value = getattr(importlib.import_module(f"minipaged.{module}"), node.name,
                                UNKNOWN)
                self.frames[0][node.name] = value if isinstance(value, type) else UNKNOWN
            elif isinstance(node, ast.FunctionDef) and not node.decorator_list \
                    and node.name not in modelled:
                self.statement(node)
                for call in ast.walk(node):
                    if isinstance(call, ast.Call) and self.call_name(call) in ENGINE_CALLS \
                            and not self.in_lambda(node, call):
                        self.sites[id(call)] = f"cell {self.cell} line {call.lineno}"

    @staticmethod
    def call_name(node: ast.Call) -> str | None:
        func = node.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)

    @staticmethod
    def in_lambda(tree, target) -> bool:
        return any(target in ast.walk(node) for node in ast.walk(tree)
                   if isinstance(node, ast.Lambda))

    # ---- the walker's hooks ----

    def import_value(self, node, alias):
        if alias.name == "numpy":
            return self.numpy
        if isinstance(node, ast.ImportFrom) and node.module == "minipaged.sizing":
            if alias.name == "release_memory":
                return Native(self.release_memory)
            if alias.name == "pinned_host_bytes":
                return Native(lambda *_: self.host_held()[1])
        if isinstance(node, ast.ImportFrom):
            return importable(node.module or "", alias.name)
        return UNKNOWN

    def loop_work(self) -> Work:
        return dataclasses.replace(self.result.work)

    def scale_loop(self, mark: Work, factor: float) -> None:
        """A loop walked only LOOP_LIMIT times: its counted work, scaled to every iteration."""
        if factor <= 1:
            return
        work = self.result.work
        for name in ("steps", "prompt_tokens", "generated_tokens", "unknown_requests",
                     "preemption_steps", "recomputed_tokens"):
            done = getattr(work, name) - getattr(mark, name)
            setattr(work, name, getattr(mark, name) + round(done * factor))

    def attribute(self, value, name: str):
        if isinstance(value, Allocation):
            return self.allocation_attribute(value, name)
        if isinstance(value, (Device, DType)):
            return getattr(value, name, UNKNOWN)
        if isinstance(value, Generator) and name == "integers":
            return Native(lambda led, a, k, n: value.integers(*a, **k))
        if isinstance(value, Shaped):
            if name == "tolist":
                return Native(lambda *_: value.tolist())
            return Native(lambda *_: value) if name in ("to", "cpu", "long", "int") else UNKNOWN
        if value is math or dataclasses.is_dataclass(value) and not isinstance(value, type):
            attribute = getattr(value, name, UNKNOWN)  # a shape's or a config's field, or method
            if callable(attribute):
                return Native(lambda led, a, k, n, f=attribute: f(*a, **k))
            return attribute
        return NOT_HANDLED

    def allocation_attribute(self, value: Allocation, name: str):
        """What the chapters reach through an engine or a model."""
        if name in ("llm_engine", "kv_cache", "scheduler"):
            return value  # these keep the engine's cache alive
        if name == "model" and value.model is not None:
            return value.model
        if name == "model" and value.config is not None:
            return value  # transformers' decoder (model.model): the same weights, a forward
        if name == "config" and value.config is not None:
            return value.config
        if name in ("to", "eval", "half", "cuda"):
            return Native(lambda led, a, k, n, v=value, m=name: self.model_to(v, m, a, k))
        if value.on_device and value.model is not None and name in ("generate", "stream"):
            return Native(lambda led, a, k, n, v=value: self.generate(v, a, k))
        if name == "set_num_cpu_blocks" and value.options.get("preemption_mode") == "swap":
            return Native(lambda led, a, k, n, v=value: self.set_num_cpu_blocks(v, a, k))
        if value.on_device and value.model is not None and name == "step":
            return Native(lambda led, a, k, n, v=value: self.forward(v.model, 1))
        if value.on_device and value.config is not None and name == "generate":
            new_tokens = lambda k: k.get("max_new_tokens", 20)  # noqa: E731
            return Native(lambda led, a, k, n, v=value: self.forward(
                v, new_tokens(k) if isinstance(new_tokens(k), int) else 1))
        return UNKNOWN

    def special_call(self, node: ast.Call, func, args: list, kwargs: dict):
        if isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained" and \
                "ForCausalLM" in ast.unparse(node.func.value):  # transformers' own model
            weights = self.from_pretrained(self, args, kwargs, node)
            return (weights, UNKNOWN) if kwargs.get("output_loading_info") else weights
        if isinstance(func, Native) and self.call_name(node) in ENGINE_CALLS:
            self.reached.add(id(node))
            try:
                return func.fn(self, args, kwargs, node)
            except (Return, Break, Continue):
                raise
            except Exception as error:  # an engine the ledger lost
                self.result.refused.append(f"line {self.line}: the ledger could not follow "
                                           f"this engine: {error!r}")
                return UNKNOWN
        if isinstance(func, Allocation) and func.on_device and func.config is not None:
            return self.forward(func, 1)  # model(input_ids, metadata, kv_cache)
        return NOT_HANDLED

    def model_to(self, model: Allocation, method: str, args, kwargs):
        """model.to(device, dtype), .half(), .cuda(), .eval() on weights."""
        if method == "eval":
            return model
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        for arg in args:
            if isinstance(arg, Device) or (isinstance(arg, str) and arg[:4] in ("cuda", "cpu")):
                device = arg
            elif isinstance(arg, DType):
                dtype = arg
        if method == "cuda":
            device = Device("cuda")
        if method == "half":
            dtype = DType("float16", 2)
        size = self.dtype_bytes(dtype, model.dtype_bytes)
        on_device = model.on_device if device is None else self.on_device(device)
        if on_device == model.on_device and size == model.dtype_bytes:
            return model
        return self.weights(model.config, DType("", size), Device("cuda" if on_device else "cpu"),
                            f"{model.what}.to()")

    def run(self, notebook: Path) -> ChapterLedger:
        for self.cell, (source, module) in enumerate(chapter_cells(notebook)):
            if module is None:
                self.run_cell(source)
            else:
                self.run_exported(source, module)
        self.result.unreached = [where for node, where in self.sites.items()
                                 if node not in self.reached]
        return self.result


def ledger(notebook: Path) -> ChapterLedger:
    """The T4 ledger of one chapter's twin."""
    from minipaged.memory import T4_CONTEXT_BYTES, T4_TOTAL_BYTES

    return Ledger(Path(notebook).stem, T4_TOTAL_BYTES, T4_CONTEXT_BYTES).run(Path(notebook))


def main() -> int:
    from minipaged.memory import T4_TOTAL_BYTES, GiB

    print(f"| chapter | peak on a T4 of {T4_TOTAL_BYTES / GiB:.2f} GiB | at | host pools and "
          f"pinned, peak (VM {COLAB_HOST_BYTES / 1e9:.1f} GB) | pinned, peak | pinned after "
          f"release() | problems |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    failed = False
    for notebook in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        result = ledger(notebook)
        problems = (result.over + result.refused + result.unsized + result.unreached
                    + result.host_over)
        failed |= bool(problems)
        peak = result.peak
        where = f"cell {peak.cell} line {peak.line}: {peak.what}" if peak else "-"
        total = f"{peak.total / GiB:.2f} GiB" if peak else "0"
        after = max(result.pinned_after_release, default=0)
        print(f"| {result.chapter} | {total} | {where} | {result.host_peak / GiB:.2f} GiB | "
              f"{result.pinned_peak / 2**20:,.0f} MiB | {after / 2**20:,.0f} MiB | "
              f"{len(problems) or ''} |")
        for problem in problems:
            print(f"    {problem}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
