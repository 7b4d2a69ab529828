"""What each chapter keeps on the GPU at full size, added up on a CPU: the T4 ledger.

A chapter at full size (``runtime.pick(full=...)``, the real Qwen2.5-0.5B-Instruct in fp16) must
fit a T4's 14.6 GiB with everything it keeps alive at once. This script checks that without a
GPU. It reads each chapter's code cells (the ``.ipynb`` twins, exported cells left out) and walks
them in order with a small interpreter that knows what the book's constructors put on the device
and what ``runtime.pick`` returns at full size:

* ``load_model(...)``, ``random_model(...)``, transformers' ``from_pretrained(...).to(device)``:
  weights, counted from the model's real configuration (Qwen2.5-0.5B's is read from chapter 6's
  ``QWEN2_5_0_5B_CONFIG`` cell), at the dtype's width;
* ``LLM(...)`` and ``LLMEngine(...)`` on the device: their KV cache, sized by the engine's own
  ``num_cache_blocks`` against the simulated card's free memory (so an engine left at the default
  ``gpu_memory_utilization`` takes what the real one would), its model's weights unless shared,
  and the activation peak of one step at ``max_num_batched_tokens`` (``activation_bytes``);
* ``KVCache(...)`` and ``torch.empty/zeros`` on the device: their bytes.

Everything else the chapters do evaluates to "unknown" and allocates nothing. An object lives as
long as a name, a container, an engine or a running statement refers to it, as in Python; ``del``
and rebinding release it. At every allocation the ledger adds what is alive, the CUDA context
(chapter 1's ``T4_CONTEXT_BYTES``) and the largest activation peak of a live engine, and compares
the sum with chapter 1's ``T4_TOTAL_BYTES``. It also lists every engine on the device that was
not given a size (``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or
``gpu_memory_utilization``), and every engine construction in a chapter that it never reached.

``python tools/t4_ledger.py`` prints the table; ``tests/test_t4_ledger.py`` asserts it.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import itertools
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAGIC = re.compile(r"^(\s*)[%!]")
ENGINE_CALLS = {"LLM", "LLMEngine"}
LOOP_LIMIT = 64  # iterations of one loop walked; what a loop allocates repeats after that


class Unknown:
    """A value the ledger does not follow; every operation on it gives Unknown again."""

    def __repr__(self) -> str:
        return "?"


UNKNOWN = Unknown()


@dataclass(eq=False)
class Allocation:
    """Bytes some object holds, on the device or not."""

    what: str
    nbytes: int
    on_device: bool
    model: Allocation | None = None  # an engine's weights
    activation: int = 0  # an engine's peak for one step
    options: dict = field(default_factory=dict)  # an engine's LLM options
    config: object = None  # a model's ModelConfig
    dtype_bytes: int = 2


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


class Native:
    """A function the ledger runs itself: fn(ledger, args, kwargs, node)."""

    def __init__(self, fn, name: str = "") -> None:
        self.fn, self.name = fn, name


class Namespace:
    """A module or object stand-in whose attributes are given (anything else is Unknown)."""

    def __init__(self, **attributes) -> None:
        self.attributes = attributes


@dataclass
class Function:
    node: ast.FunctionDef
    defaults: list
    kw_defaults: dict


class Return(Exception):
    def __init__(self, value) -> None:
        self.value = value


class Break(Exception):
    pass


class Continue(Exception):
    pass


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


@dataclass
class Work:
    """The model work a chapter asks of the GPU at full size, as the ledger counts it: steps
    (forward passes), prompt tokens computed, tokens generated; requests of unknown length."""

    steps: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    unknown_requests: int = 0
    weight_bytes: int = 0  # the largest model the chapter runs, for the bandwidth floor


def activation_bytes(config, num_tokens: int, num_rows: int, dtype_bytes: int) -> int:
    """An upper bound on one step's transient memory: for each of num_tokens tokens, the
    residual, normed and attention-output rows (4 x hidden), q, k, v, the MLP's gate, up and
    activated rows (3 x intermediate) in the model's dtype, held together in one layer; and the
    logits of num_rows sampled rows over the vocabulary in fp32, twice (logits, probabilities)."""
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


def items(iterable) -> list:
    """The first LOOP_LIMIT items of a value the ledger can iterate, else one Unknown."""
    if isinstance(iterable, (Unknown, Allocation, Namespace, Native, Function)) or not hasattr(
            iterable, "__iter__"):
        return [UNKNOWN]
    return list(itertools.islice(iterable, LOOP_LIMIT))


def length(iterable) -> int:
    """How many items a loop over iterable runs (1 when the ledger cannot tell)."""
    try:
        return max(1, len(iterable)) if not isinstance(iterable, (Unknown, Shaped)) else 1
    except TypeError:
        return 1


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


class Ledger:
    """Walks one chapter's cells; see the module's docstring."""

    def __init__(self, chapter: str, total_bytes: int, context_bytes: int) -> None:
        import minipaged.engine
        import minipaged.model

        self.engine_module, self.ModelConfig = minipaged.engine, minipaged.model.ModelConfig
        self.result = ChapterLedger(chapter)
        self.total_bytes, self.context_bytes = total_bytes, context_bytes
        self.qwen = qwen_config()
        self.frames: list[dict] = [self.globals()]
        self.temps: list[list] = [[]]
        self.line = 0
        self.reached: set[int] = set()  # the engine constructions evaluated
        self.sites: dict[int, str] = {}  # every engine construction outside a lambda
        self.cell = 0

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
            "LLM": Native(self.llm), "LLMEngine": Native(self.llm_engine),
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
        builtins = {name: Native(lambda led, a, k, n, f=f: f(*a, **k), name) for name, f in {
            "min": min, "max": max, "int": int, "float": float, "len": len, "range": range,
            "list": list, "dict": dict, "tuple": tuple, "sum": sum, "sorted": sorted,
            "round": round, "abs": abs, "enumerate": enumerate, "zip": zip, "str": str,
            "bool": bool, "set": set, "reversed": reversed, "any": any, "all": all,
            "isinstance": lambda *a: UNKNOWN, "print": lambda *a, **k: None}.items()}
        return builtins | native

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
            config = self.engine_module.PRESETS["random"]()
            return self.weights(config, dtype, device, "LLM(model='random')")
        if isinstance(model, str):
            return self.weights(self.qwen, dtype, device, f"LLM(model={model!r})")
        return UNKNOWN

    def engine(self, model: Allocation, options: dict, what: str,
               num_blocks=None) -> Allocation | Unknown:
        """Size an engine as LLM does, on the simulated card, and book its cache."""
        engine = self.engine_module
        if not model.on_device:
            return self.allocate(Allocation(what, 0, False, model=model))
        config, block_size = model.config, options.get("block_size", 16)
        limit = options.get("max_model_len")
        longest = min(limit or config.max_position_embeddings, config.max_position_embeddings)
        max_num_seqs = options.get("max_num_seqs", 256)
        tokens = options.get("max_num_batched_tokens", 2048)
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
                num_blocks = engine.num_cache_blocks(
                    block_bytes, block_size, longest, max_num_seqs,
                    options.get("gpu_memory_utilization", 0.9),
                    options.get("kv_cache_memory_bytes"), (free, self.total_bytes),
                    lambda: activation)
            if not isinstance(num_blocks, int):
                raise ValueError(f"a number of blocks the ledger cannot follow: {num_blocks}")
            if num_blocks < math.ceil(longest / block_size):
                raise ValueError(f"{num_blocks} blocks cannot hold one sequence of {longest}")
        except ValueError as error:
            self.result.refused.append(f"line {self.line}: {what}: {error}")
            return UNKNOWN
        return self.allocate(Allocation(f"{what}: {num_blocks:,} blocks",
                                        num_blocks * block_bytes, True, model=model,
                                        activation=activation,
                                        options=dict(max_num_seqs=max_num_seqs,
                                                     max_num_batched_tokens=tokens)))

    # ---- work ----

    def generate(self, engine: Allocation, args, kwargs) -> Unknown:
        """Count the steps and tokens of llm.generate / llm.stream: prompts prefilled in steps
        of max_num_batched_tokens, then one step per generated token for each batch of
        max_num_seqs requests (preemption's extra steps are not counted)."""
        prompts = args[0] if args else kwargs.get("prompts", UNKNOWN)
        params = args[1] if len(args) > 1 else kwargs.get("sampling_params", Params({}))
        prompts = [prompts] if isinstance(prompts, (dict, str)) else prompts
        if not isinstance(prompts, (list, tuple)):
            self.result.work.unknown_requests += 1
            return UNKNOWN
        params = params if isinstance(params, list) else [params] * len(prompts)
        work, options = self.result.work, engine.options
        lengths, answers = [], []
        for prompt, param in zip(prompts, params):
            ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
            n, max_tokens = getattr(param, "n", 1), getattr(param, "max_tokens", 16)
            if not isinstance(ids, list) or not isinstance(max_tokens, int):
                work.unknown_requests += 1
                continue
            lengths.append(len(ids))
            answers += [max_tokens] * (n if isinstance(n, int) else 1)
        seqs, budget = options.get("max_num_seqs", 256), options.get("max_num_batched_tokens",
                                                                      2048)
        batches = [answers[i:i + seqs] for i in range(0, len(answers), seqs)]
        work.steps += math.ceil(sum(lengths) / budget) + sum(max(b) for b in batches)
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

    def llm(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        model = self.model_of(args[0] if args else kwargs.get("model", "random"), kwargs)
        if not isinstance(model, Allocation) or model.config is None:
            self.result.errors.append(f"line {self.line}: LLM of an unknown model")
            return UNKNOWN
        return self.engine(model, kwargs, "LLM")

    def llm_engine(self, ledger, args, kwargs, node) -> Allocation | Unknown:
        names = ["model", "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens"]
        given = dict(zip(names, args)) | kwargs
        model = given.get("model")
        if not isinstance(model, Allocation) or model.config is None:
            self.result.errors.append(f"line {self.line}: LLMEngine of an unknown model")
            return UNKNOWN
        return self.engine(model, given, "LLMEngine", num_blocks=given.get("num_gpu_blocks"))

    # ---- statements ----

    def run_cell(self, source: str) -> None:
        code = "\n".join(MAGIC.sub(r"\1pass  # ", line) if MAGIC.match(line) else line
                         for line in source.splitlines())
        try:
            tree = ast.parse(code)
        except SyntaxError as error:
            self.result.errors.append(f"cell {self.cell}: {error}")
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

    def block(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        self.line = getattr(node, "lineno", self.line)
        try:
            self._statement(node)
        except (Return, Break, Continue):
            raise
        except Exception as error:  # a construct the ledger does not follow
            self.result.errors.append(f"cell {self.cell} line {self.line}: "
                                      f"{type(error).__name__}: {error}")
            for target in ast.walk(node):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    self.frames[-1][target.id] = UNKNOWN
        finally:
            if not isinstance(node, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
                self.temps[-1] = []

    def _statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr):
            self.eval(node.value)
        elif isinstance(node, ast.Assign):
            value = self.eval(node.value)
            for target in node.targets:
                self.bind(target, value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            self.bind(node.target, self.eval(node.value))
        elif isinstance(node, ast.AugAssign):
            old, new = self.eval(node.target), self.eval(node.value)
            self.bind(node.target, self.binop(node.op, old, new))
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                self.unbind(target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                name = (alias.asname or alias.name).split(".")[0]
                if alias.name == "numpy":
                    self.frames[-1][name] = self.numpy
                elif isinstance(node, ast.ImportFrom) and name not in self.frames[0]:
                    self.frames[-1][name] = importable(node.module or "", alias.name)
                elif name not in self.frames[0]:
                    self.frames[-1][name] = UNKNOWN
        elif isinstance(node, ast.FunctionDef):
            defaults = [self.eval(d) for d in node.args.defaults]
            kw = {a.arg: self.eval(d) for a, d in zip(node.args.kwonlyargs,
                                                       node.args.kw_defaults) if d is not None}
            self.frames[-1][node.name] = Function(node, defaults, kw)
        elif isinstance(node, ast.ClassDef):
            self.frames[-1][node.name] = UNKNOWN
        elif isinstance(node, ast.For):
            self.loop(node)
        elif isinstance(node, ast.While):
            try:
                self.block(node.body)
            except Break:
                pass
        elif isinstance(node, ast.If):
            test = self.eval(node.test)
            self.block(node.orelse if test is not UNKNOWN and not test else node.body)
        elif isinstance(node, ast.With):
            for item in node.items:
                value = self.eval(item.context_expr)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, value)
            self.block(node.body)
        elif isinstance(node, ast.Try):
            self.block(node.body)
            self.block(node.orelse)
            self.block(node.finalbody)
        elif isinstance(node, ast.Return):
            raise Return(self.eval(node.value) if node.value is not None else None)
        elif isinstance(node, ast.Break):
            raise Break
        elif isinstance(node, ast.Continue):
            raise Continue
        # assert, raise, pass, global: nothing to book

    def loop(self, node: ast.For) -> None:
        iterable = self.eval(node.iter)
        values = items(iterable)
        before = dataclasses.replace(self.result.work)
        try:
            for value in values:
                self.bind(node.target, value)
                try:
                    self.block(node.body)
                except Continue:
                    continue
            else:
                self.block(node.orelse)
        except Break:
            pass
        self.scale_work(before, length(iterable) / max(1, len(values)))

    def scale_work(self, before: Work, factor: float) -> None:
        """A loop walked only LOOP_LIMIT times: its counted work, scaled to every iteration."""
        if factor <= 1:
            return
        work = self.result.work
        for name in ("steps", "prompt_tokens", "generated_tokens", "unknown_requests"):
            done = getattr(work, name) - getattr(before, name)
            setattr(work, name, getattr(before, name) + round(done * factor))

    def bind(self, target: ast.expr, value) -> None:
        if isinstance(target, ast.Name):
            self.frames[-1][target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            items = list(value) if isinstance(value, (tuple, list)) and len(value) == len(
                target.elts) else [UNKNOWN] * len(target.elts)
            for element, item in zip(target.elts, items):
                self.bind(element, item)
        elif isinstance(target, ast.Subscript):
            container, key = self.eval(target.value), self.eval(target.slice)
            if isinstance(container, dict) and key is not UNKNOWN:
                container[key] = value
            elif isinstance(container, list) and isinstance(key, int):
                container[key] = value
        # attributes: the object keeps its own references; nothing to book

    def unbind(self, target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            for frame in reversed(self.frames):
                if target.id in frame:
                    del frame[target.id]
                    return
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self.unbind(element)
        elif isinstance(target, ast.Subscript):
            container, key = self.eval(target.value), self.eval(target.slice)
            if isinstance(container, dict):
                container.pop(key, None)

    # ---- expressions ----

    def lookup(self, name: str):
        for frame in (self.frames[-1], self.frames[0]):
            if name in frame:
                return frame[name]
        return UNKNOWN

    def eval(self, node: ast.expr):
        method = getattr(self, f"eval_{type(node).__name__}", None)
        return UNKNOWN if method is None else method(node)

    def eval_Constant(self, node):
        return node.value

    def eval_Name(self, node):
        return self.lookup(node.id)

    def eval_Tuple(self, node):
        return tuple(self.eval(e) for e in node.elts)

    def eval_List(self, node):
        return [self.eval(e) for e in node.elts]

    def eval_Set(self, node):
        values = [self.eval(e) for e in node.elts]
        try:
            return set(values)
        except TypeError:
            return UNKNOWN

    def eval_Dict(self, node):
        result = {}
        for key, value in zip(node.keys, node.values):
            if key is None:
                merged = self.eval(value)
                if isinstance(merged, dict):
                    result.update(merged)
            else:
                key = self.eval(key)
                try:
                    result[key] = self.eval(value)
                except TypeError:
                    pass
        return result

    def eval_JoinedStr(self, node):
        return UNKNOWN

    def eval_Lambda(self, node):
        return UNKNOWN

    def eval_IfExp(self, node):
        test = self.eval(node.test)
        if test is UNKNOWN:
            return self.eval(node.body)
        return self.eval(node.body if test else node.orelse)

    def eval_Attribute(self, node):
        value = self.eval(node.value)
        name = node.attr
        if isinstance(value, Namespace):
            return value.attributes.get(name, UNKNOWN)
        if isinstance(value, Allocation):
            if name in ("llm_engine", "kv_cache", "scheduler"):
                return value  # these keep the engine's cache alive
            if name == "model" and value.model is not None:
                return value.model
            if name == "config" and value.config is not None:
                return value.config
            if name in ("to", "eval", "half", "cuda"):
                return Native(lambda led, a, k, n, v=value, m=name: self.model_to(v, m, a, k))
            if value.on_device and value.model is not None and name in ("generate", "stream"):
                return Native(lambda led, a, k, n, v=value: self.generate(v, a, k))
            if value.on_device and value.model is not None and name == "step":
                return Native(lambda led, a, k, n, v=value: self.forward(v.model, 1))
            if value.on_device and value.config is not None and name == "generate":
                return Native(lambda led, a, k, n, v=value: self.forward(
                    v, k.get("max_new_tokens", 20) if isinstance(k.get("max_new_tokens", 20),
                                                                int) else 1))
            return UNKNOWN
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
        if isinstance(value, (dict, list, str, tuple, range, set)) and not name.startswith("_"):
            attribute = getattr(value, name, UNKNOWN)
            if callable(attribute):
                return Native(lambda led, a, k, n, f=attribute: f(*a, **k))
            return attribute
        return UNKNOWN

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

    def eval_Subscript(self, node):
        value, key = self.eval(node.value), self.eval(node.slice)
        if isinstance(value, (dict, list, tuple, str, range)) and key is not UNKNOWN:
            try:
                return value[key]
            except (KeyError, IndexError, TypeError):
                return UNKNOWN
        return UNKNOWN

    def eval_Slice(self, node):
        parts = [None if p is None else self.eval(p) for p in (node.lower, node.upper, node.step)]
        return UNKNOWN if UNKNOWN in parts else slice(*parts)

    def binop(self, op, left, right):
        if left is UNKNOWN or right is UNKNOWN or isinstance(left, Allocation) or isinstance(
                right, Allocation):
            return UNKNOWN
        operators = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                     ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
                     ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
                     ast.Pow: lambda a, b: a ** b, ast.BitOr: lambda a, b: a | b}
        try:
            return operators[type(op)](left, right)
        except Exception:
            return UNKNOWN

    def eval_BinOp(self, node):
        return self.binop(node.op, self.eval(node.left), self.eval(node.right))

    def eval_UnaryOp(self, node):
        value = self.eval(node.operand)
        if value is UNKNOWN:
            return UNKNOWN
        try:
            return {ast.USub: lambda v: -v, ast.UAdd: lambda v: +v, ast.Not: lambda v: not v,
                    ast.Invert: lambda v: ~v}[type(node.op)](value)
        except Exception:
            return UNKNOWN

    def eval_BoolOp(self, node):
        values = [self.eval(v) for v in node.values]
        if UNKNOWN in values:
            return UNKNOWN
        return all(values) if isinstance(node.op, ast.And) else any(values)

    def eval_Compare(self, node):
        left = self.eval(node.left)
        operators = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
                     ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
                     ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
                     ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b,
                     ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
        for op, comparator in zip(node.ops, node.comparators):
            right = self.eval(comparator)
            if left is UNKNOWN or right is UNKNOWN:
                return UNKNOWN
            try:
                if not operators[type(op)](left, right):
                    return False
            except Exception:
                return UNKNOWN
            left = right
        return True

    def comprehension(self, node, element):
        """Evaluate a comprehension, element(…) once per item; each result is kept alive."""
        results, frame = [], dict(self.frames[-1])
        self.frames.append(frame)

        def walk(generators):
            if not generators:
                value = element()
                self.temps[-1].append(value)
                results.append(value)
                return
            first = generators[0]
            iterable = self.eval(first.iter)
            values, before = items(iterable), dataclasses.replace(self.result.work)
            for item in values:
                self.bind(first.target, item)
                if all(self.eval(test) is not False for test in first.ifs):
                    walk(generators[1:])
            self.scale_work(before, length(iterable) / max(1, len(values)))

        try:
            walk(node.generators)
        finally:
            self.frames.pop()
        return results

    def eval_ListComp(self, node):
        return self.comprehension(node, lambda: self.eval(node.elt))

    eval_GeneratorExp = eval_ListComp

    def eval_SetComp(self, node):
        return UNKNOWN if self.comprehension(node, lambda: self.eval(node.elt)) else set()

    def eval_DictComp(self, node):
        pairs = self.comprehension(node, lambda: (self.eval(node.key), self.eval(node.value)))
        try:
            return dict(pairs)
        except TypeError:
            return UNKNOWN

    def eval_Call(self, node):
        func = self.eval(node.func)
        args = []
        for arg in node.args:
            if isinstance(arg, ast.Starred):
                value = self.eval(arg.value)
                args.extend(value if isinstance(value, (list, tuple)) else [UNKNOWN])
            else:
                args.append(self.eval(arg))
        kwargs = {}
        for keyword in node.keywords:
            value = self.eval(keyword.value)
            if keyword.arg is not None:
                kwargs[keyword.arg] = value
            elif isinstance(value, dict):
                kwargs.update(value)
        self.temps[-1].extend(a for a in args if isinstance(a, Allocation))
        if isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained" and \
                "ForCausalLM" in ast.unparse(node.func.value):  # transformers' own model
            weights = self.from_pretrained(self, args, kwargs, node)
            return (weights, UNKNOWN) if kwargs.get("output_loading_info") else weights
        if isinstance(func, Native):
            if self.call_name(node) in ENGINE_CALLS:
                self.reached.add(id(node))
            try:
                return func.fn(self, args, kwargs, node)
            except (Return, Break, Continue):
                raise
            except Exception as error:
                if self.call_name(node) in ENGINE_CALLS:  # an engine the ledger lost
                    self.result.refused.append(f"line {self.line}: the ledger could not "
                                               f"follow this engine: {error!r}")
                return UNKNOWN
        if isinstance(func, Function):
            return self.call(func, args, kwargs)
        if isinstance(func, Allocation) and func.on_device and func.config is not None:
            return self.forward(func, 1)  # model(input_ids, metadata, kv_cache)
        return UNKNOWN

    def call(self, function: Function, args, kwargs):
        """Run a chapter's own function with its arguments bound, in a frame of its own."""
        if len(self.frames) > 20:
            return UNKNOWN
        spec, frame = function.node.args, {}
        names = [a.arg for a in spec.posonlyargs + spec.args]
        defaults = dict(zip(names[len(names) - len(function.defaults):], function.defaults))
        for name, value in zip(names, args):
            frame[name] = value
        if spec.vararg is not None:
            frame[spec.vararg.arg] = tuple(args[len(names):])
        extra = {}
        for name, value in kwargs.items():
            (frame.__setitem__(name, value) if name in names or name in [
                a.arg for a in spec.kwonlyargs] else extra.__setitem__(name, value))
        for name in names:
            frame.setdefault(name, defaults.get(name, UNKNOWN))
        for argument in spec.kwonlyargs:
            frame.setdefault(argument.arg, function.kw_defaults.get(argument.arg, UNKNOWN))
        if spec.kwarg is not None:
            frame[spec.kwarg.arg] = extra
        self.frames.append(frame)
        self.temps.append([])
        try:
            self.block(function.node.body)
            value = None
        except Return as returned:
            value = returned.value
        finally:
            self.frames.pop()
            self.temps.pop()
        self.temps[-1].append(value)
        return value

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

    print(f"| chapter | peak on a T4 of {T4_TOTAL_BYTES / GiB:.2f} GiB | at | problems |")
    print("| --- | --- | --- | --- |")
    failed = False
    for notebook in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")):
        result = ledger(notebook)
        problems = result.over + result.refused + result.unsized + result.unreached
        failed |= bool(problems)
        peak = result.peak
        where = f"cell {peak.cell} line {peak.line}: {peak.what}" if peak else "-"
        total = f"{peak.total / GiB:.2f} GiB" if peak else "0"
        print(f"| {result.chapter} | {total} | {where} | {len(problems) or ''} |")
        for problem in problems:
            print(f"    {problem}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
