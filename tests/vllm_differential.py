"""vLLM's block pool and KV-cache manager driven beside minipaged's, one operation at a time.

A *run* builds one vLLM ``KVCacheManager`` (loaded by ``vllm_release``) and the matching
minipaged manager, then applies a sequence of operations to both, the way a scheduler would:
admit a request (look up its cached prefix, allocate its slots, book its tokens as computed),
decode a token, finish a request, preempt one and bring it back, reset the prefix cache, ask the
pool for more blocks than it has. After every operation it compares what a user of each could
observe: the free count, the free queue's order, every block's reference count, which blocks
carry which hash (as a one-to-one pairing of vLLM's hashes with minipaged's: the two hash
functions differ, the structure must not), each request's blocks, what ``allocate_slots`` and
``get_computed_blocks`` returned, and the prefix-cache counters.

The differences that remain between the two are rows of ``book/vllm_differences.csv``, which
the book shows on its "minipaged and vLLM" page. A row's ``key`` is what this module reads:
each key allows exactly one named, narrow divergence (see ``ALLOWANCES``); a divergence that no
listed row allows is a failure, and so is a row whose key this module does not know.
"""
from __future__ import annotations

import csv
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minipaged.blocks import BlockPool, NoFreeBlocksError
from minipaged.prefix_cache import PrefixCachingBlockPool, PrefixCachingKVCacheManager
from minipaged.sampling import SamplingParams as MiniSamplingParams
from minipaged.scheduler import KVCacheManager as MiniKVCacheManager
from minipaged.scheduler import Request as MiniRequest
from minipaged.scheduler import RequestStatus as MiniStatus

TABLE = Path(__file__).resolve().parent.parent / "book" / "vllm_differences.csv"
COLUMNS = ["key", "difference", "minipaged", "vllm", "why"]
BLOCK_SIZE = 4
VOCAB = 50  # token values of tails and decodes: prompts share only the fixed prefixes

# Each key of the table: the one divergence it allows, as the comparison below applies it.
ALLOWANCES = {
    "null_block": "vLLM's pool of N+1 blocks lends N: block 0 is its null block; ids are "
                  "compared as vLLM's minus one",
    "plain_free_order": "prefix caching off: freed blocks join the tail here, the head in "
                        "vLLM, so block ids and the queue's order are not compared, only counts",
    "duplicate_blocks": "a full block computed again while its hash is cached: vLLM caches the "
                        "copy too, minipaged leaves it uncached; the run stops there",
    "no_free_blocks_error": "asking the pool for more blocks than are free raises "
                            "NoFreeBlocksError here, ValueError in vLLM; both change nothing",
    "computed_blocks_triple": "get_computed_blocks returns (blocks, tokens) here, (blocks, "
                              "tokens, shared_prefix_boundary) in vLLM, whose third is 0 for "
                              "full attention",
    "eviction_counter": "minipaged's prefix_cache_evictions has no counterpart in vLLM's "
                        "PrefixCacheStats, so it is not compared",
    "reset_flag": "vLLM's PrefixCacheStats.reset, set by reset_prefix_cache, has no counterpart "
                  "here, so it is not compared",
    "computed_after_step": "the engine books computed tokens after the step; the managers are "
                           "driven as vLLM's scheduler drives them, booking each step at once",
}


def read_table(path: Path = TABLE) -> dict[str, dict[str, str]]:
    """The listed differences by key; a key this module does not know is an error."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if rows and list(rows[0]) != COLUMNS:
        raise ValueError(f"{path}: columns must be {COLUMNS}, got {list(rows[0])}")
    table = {row["key"]: row for row in rows}
    unknown = set(table) - set(ALLOWANCES)
    if unknown:
        raise ValueError(f"{path}: keys {sorted(unknown)} allow nothing the test knows")
    return table


class Divergence(AssertionError):
    """The two managers differ in a way no listed difference allows."""


class Listed(Exception):
    """The run reached a listed difference after which the two cannot be compared further."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


# --- operations --------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    name: str  # admit, decode, finish, preempt, resume, reset, dry
    arg: int = 0  # which request (an index into the live ones, modulo their number)
    prefix: int = 0  # admit: which shared prefix
    length: int = 0  # admit: tokens after the prefix; decode: the token appended
    size: int = 0  # dry: blocks asked beyond the free ones

    def __str__(self) -> str:
        if self.name == "admit":
            return f"admit(prefix={self.prefix}, tail={self.length})"
        if self.name == "decode":
            return f"decode(request #{self.arg}, token={self.length})"
        if self.name == "dry":
            return f"dry(free + {self.size})"
        if self.name == "reset":
            return "reset()"
        return f"{self.name}(request #{self.arg})"


def random_ops(seed: int, n: int) -> list[Op]:
    """A seeded sequence: mostly admissions and decodes, with finishes, preemptions, resets."""
    rng = random.Random(seed)
    weights = {"admit": 5, "decode": 9, "finish": 2, "preempt": 2, "resume": 2, "reset": 1,
               "dry": 1}
    names, w = list(weights), list(weights.values())
    ops = []
    for _ in range(n):
        name = rng.choices(names, w)[0]
        ops.append(Op(name, arg=rng.randrange(8), prefix=rng.randrange(3),
                      length=rng.randrange(0, 11) if name == "admit" else rng.randrange(VOCAB),
                      size=rng.randrange(1, 4)))
    return ops


PREFIXES = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [1, 2, 3, 4, 0, 0], [6, 5, 4]]  # 0 and 1 share a block


def tail_tokens(op: Op, serial: int) -> list[int]:
    rng = random.Random(hash((op.length, op.prefix, serial)) & 0xFFFF)
    return [rng.randrange(VOCAB) for _ in range(op.length)]


# --- the two sides ----------------------------------------------------------------------

class VllmSide:
    """vLLM's KVCacheManager over one full-attention group, with its own Request objects."""

    def __init__(self, v: Any, num_blocks: int, caching: bool, max_model_len: int) -> None:
        self.v = v
        spec = v.interface.FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1,
                                             head_size=8, dtype=_Float16)
        config = v.interface.KVCacheConfig(
            num_blocks=num_blocks + 1, kv_cache_tensors=[],
            kv_cache_groups=[v.interface.KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = v.manager.KVCacheManager(
            config, max_model_len=max_model_len, scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE, enable_caching=caching, log_stats=True)
        self.pool = self.manager.block_pool
        sha256 = sys.modules["vllm.utils.hashing"].sha256  # vLLM's default hash (see the stub)
        v.utils.init_none_hash(sha256)
        self.hasher = v.utils.get_request_block_hasher(BLOCK_SIZE, sha256)

    def request(self, request_id: str, tokens: list[int]) -> Any:
        params = _VllmSamplingParams()
        return self.v.request.Request(request_id, list(tokens), params, None,
                                      block_hasher=self.hasher)


class _VllmSamplingParams:
    """What vLLM's Request reads of its sampling parameters (the real class is stubbed)."""

    max_tokens = 1 << 20
    extra_args = None
    n = 1

    def __getattr__(self, name: str) -> None:  # every other optional field: unset, as default
        return None


class _Float16:  # a dtype stand-in: vLLM's spec asks only its size on these paths
    itemsize = 2


@dataclass
class Live:
    vreq: Any
    mreq: MiniRequest
    running: bool = True


@dataclass
class Run:
    """Both managers, the live requests and the pairing of vLLM's hashes with minipaged's."""

    v: Any
    caching: bool
    num_blocks: int
    allowed: set[str]
    vside: VllmSide = field(init=False)
    mini: Any = field(init=False)
    live: list[Live] = field(default_factory=list)
    serial: int = 0
    hash_pairs: dict[bytes, bytes] = field(default_factory=dict)
    hash_pairs_back: dict[bytes, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        max_model_len = self.num_blocks * BLOCK_SIZE * 4
        self.vside = VllmSide(self.v, self.num_blocks, self.caching, max_model_len)
        if self.caching:
            self.mini = PrefixCachingKVCacheManager(
                PrefixCachingBlockPool(self.num_blocks, BLOCK_SIZE))
        else:
            self.mini = MiniKVCacheManager(BlockPool(self.num_blocks, BLOCK_SIZE))
        if "null_block" not in self.allowed:
            raise Divergence("vLLM's pool lends one block fewer than it is given (its null "
                             "block), so no pool compares without 'null_block' listed")

    # -- helpers --
    def vid(self, block: Any) -> int:
        return block.block_id - 1  # null_block: vLLM's block 0 is never lent

    def pick(self, op: Op, running: bool | None) -> Live | None:
        pool = [r for r in self.live if running is None or r.running == running]
        return pool[op.arg % len(pool)] if pool else None

    # -- operations --
    def apply(self, op: Op) -> None:
        getattr(self, "op_" + op.name)(op)
        self.compare(op)

    def op_admit(self, op: Op) -> None:
        self.serial += 1
        tokens = PREFIXES[op.prefix] + tail_tokens(op, self.serial)
        if not tokens:
            return
        rid = f"r{self.serial}"
        vreq = self.vside.request(rid, tokens)
        mreq = MiniRequest(rid, list(tokens), MiniSamplingParams(max_tokens=1 << 20))
        item = Live(vreq, mreq, running=False)
        if self.admit(item):
            self.live.append(item)

    def admit(self, item: Live) -> bool:
        """What a scheduler does to start (or restart) a request: look up, allocate, book."""
        vreq, mreq = item.vreq, item.mreq
        vfound = self.vside.manager.get_computed_blocks(vreq)
        mfound = self.mini.get_computed_blocks(mreq)
        vblocks, vtokens = list(vfound[0].blocks[0]), vfound[1]
        if len(vfound) == 3:
            if "computed_blocks_triple" not in self.allowed or vfound[2] != 0:
                raise Divergence(f"get_computed_blocks: vLLM returned {len(vfound)} values "
                                 f"{vfound[1:]}, minipaged {len(mfound)}")
        self.expect("get_computed_blocks", ([self.vid(b) for b in vblocks], vtokens),
                    ([b.block_id for b in mfound[0]], mfound[1]), ids=True)
        num_new = vreq.num_tokens - vreq.num_computed_tokens - vtokens
        vresult = self.vside.manager.allocate_slots(
            vreq, num_new, vtokens, vfound[0] if vtokens else None)
        mresult = self.mini.allocate_slots(mreq, num_new, mfound[0])
        self.compare_allocation(vresult, mresult)
        if vresult is None:
            return False
        if self.caching:  # vLLM's scheduler records the lookup once the request is admitted
            self.vside.manager.record_prefix_cache_stats(vreq, vtokens)
        for req in (vreq, mreq):
            req.num_computed_tokens = req.num_tokens
        vreq.status, mreq.status = self.v.request.RequestStatus.RUNNING, MiniStatus.RUNNING
        item.running = True
        return True

    def op_decode(self, op: Op) -> None:
        item = self.pick(op, running=True)
        if item is None or item.vreq.num_tokens >= self.vside.manager.max_model_len - 1:
            return
        item.vreq.append_output_token_ids(op.length)
        item.mreq.append_output_token(op.length)
        vresult = self.vside.manager.allocate_slots(item.vreq, 1)
        mresult = self.mini.allocate_slots(item.mreq, 1)
        self.compare_allocation(vresult, mresult)
        if vresult is None:  # no room: the scheduler preempts it
            self.preempt(item)
            return
        for req in (item.vreq, item.mreq):
            req.num_computed_tokens += 1

    def op_finish(self, op: Op) -> None:
        item = self.pick(op, running=None)
        if item is None:
            return
        if item.running:
            self.vside.manager.free(item.vreq)
            self.mini.free(item.mreq)
        self.live.remove(item)

    def preempt(self, item: Live) -> None:
        """vLLM's Scheduler._preempt_request: free, zero computed tokens, count it."""
        self.vside.manager.free(item.vreq)
        self.mini.free(item.mreq)
        for req in (item.vreq, item.mreq):
            req.num_computed_tokens = 0
            req.num_preemptions += 1
        item.vreq.status = self.v.request.RequestStatus.PREEMPTED
        item.mreq.status = MiniStatus.PREEMPTED
        item.running = False

    def op_preempt(self, op: Op) -> None:
        item = self.pick(op, running=True)
        if item is not None:
            self.preempt(item)

    def op_resume(self, op: Op) -> None:
        item = self.pick(op, running=False)
        if item is not None:
            self.admit(item)

    def op_reset(self, op: Op) -> None:
        vok = self.vside.manager.reset_prefix_cache()
        mok = self.mini.reset_prefix_cache()
        self.expect("reset_prefix_cache", vok, mok)

    def op_dry(self, op: Op) -> None:
        """Ask each pool for more blocks than are free: both refuse and change nothing."""
        ask = self.vside.pool.get_num_free_blocks() + op.size
        errors = []
        for pool in (self.vside.pool, self.mini.pool):
            try:
                pool.get_new_blocks(ask)
                errors.append(None)
            except (ValueError, NoFreeBlocksError) as error:
                errors.append(type(error).__name__)
        if errors == ["ValueError", "NoFreeBlocksError"] and "no_free_blocks_error" in self.allowed:
            return
        self.expect("get_new_blocks(more than free) raised", errors[0], errors[1])

    # -- comparison --
    def expect(self, what: str, vllm: Any, mini: Any, ids: bool = False) -> None:
        if ids and not self.caching and "plain_free_order" in self.allowed:
            vllm, mini = _shape(vllm), _shape(mini)
        if vllm != mini:
            raise Divergence(f"{what}: vLLM {vllm!r}, minipaged {mini!r}")

    def compare_allocation(self, vresult: Any, mresult: Any) -> None:
        if (vresult is None) != (mresult is None):
            raise Divergence(f"allocate_slots: vLLM {'None' if vresult is None else 'blocks'}, "
                             f"minipaged {mresult!r}")
        if bool(vresult) != bool(mresult):
            raise Divergence(f"allocate_slots: truthiness differs: vLLM {bool(vresult)}, "
                             f"minipaged {bool(mresult)} ({mresult!r})")
        if vresult is not None:
            self.expect("allocate_slots new blocks",
                        [self.vid(b) for b in vresult.blocks[0]],
                        [b.block_id for b in mresult], ids=True)

    def compare(self, op: Op) -> None:
        vpool, mpool = self.vside.pool, self.mini.pool
        self.expect("free blocks", vpool.get_num_free_blocks(), mpool.get_num_free_blocks())
        vqueue = [self.vid(b) for b in vpool.free_block_queue.get_all_free_blocks()]
        mqueue = [b.block_id for b in mpool.free_block_queue]
        self.expect("free queue", vqueue, mqueue, ids=True)
        vrefs = [b.ref_cnt for b in vpool.blocks[1:]]
        mrefs = [b.ref_cnt for b in mpool.blocks]
        if self.caching or "plain_free_order" not in self.allowed:
            self.expect("reference counts", vrefs, mrefs)
        for item in self.live:
            vtable = [self.vid(b) for b in
                      self.vside.manager.coordinator.single_type_managers[0].req_to_blocks.get(
                          item.vreq.request_id, [])]
            mtable = self.mini.block_tables.get(item.mreq.request_id)
            mids = mtable.block_ids if mtable is not None else []
            self.expect(f"blocks of {item.vreq.request_id}", vtable, mids, ids=True)
            if not self.caching and "plain_free_order" in self.allowed:
                self.expect(f"reference counts of {item.vreq.request_id}'s blocks",
                            [vpool.blocks[i + 1].ref_cnt for i in vtable],
                            [mpool.blocks[i].ref_cnt for i in mids])
        if self.caching:
            self.compare_hashes()
            vstats = self.vside.manager.prefix_cache_stats
            mstats = self.mini.prefix_cache_stats
            names = ["requests", "queries", "hits", "preempted_requests", "preempted_queries",
                     "preempted_hits"]
            if "reset_flag" not in self.allowed:
                names.append("reset")
            vcounts = {n: getattr(vstats, n, None) for n in names}
            mcounts = {n: getattr(mstats, n, None) for n in names}
            if "eviction_counter" not in self.allowed:
                vcounts["evictions"] = getattr(vstats, "evictions", None)
                mcounts["evictions"] = self.mini.pool.num_evictions
            self.expect("prefix-cache counters", vcounts, mcounts)

    def compare_hashes(self) -> None:
        vpool, mpool = self.vside.pool, self.mini.pool
        for vblock, mblock in zip(vpool.blocks[1:], mpool.blocks):
            vh, mh = vblock.block_hash, mblock.block_hash
            if vh is not None and mh is None and self.is_vllm_duplicate(vblock):
                if "duplicate_blocks" in self.allowed:
                    raise Listed("duplicate_blocks")
            if (vh is None) != (mh is None):
                raise Divergence(f"block {mblock.block_id}: vLLM hash {vh!r}, minipaged {mh!r}")
            if vh is None:
                continue
            if self.hash_pairs.setdefault(vh, mh) != mh or \
                    self.hash_pairs_back.setdefault(mh, vh) != vh:
                raise Divergence(f"block {mblock.block_id} carries a hash the other side gives "
                                 "another block's content")
        vmap = set(_cached_ids(vpool))
        mmap = {b.block_id + 1 for b in mpool.cached_block_hash_to_block.values()}
        if vmap != mmap:
            raise Divergence(f"cached blocks: vLLM {sorted(i - 1 for i in vmap)}, "
                             f"minipaged {sorted(i - 1 for i in mmap)}")

    def is_vllm_duplicate(self, block: Any) -> bool:
        found = self.vside.pool.cached_block_hash_to_block.get_one_block(block.block_hash)
        return found is not None and found is not block


def _cached_ids(pool: Any) -> list[int]:
    """The blocks vLLM's map finds under their hash (BlockHashToBlockMap.contain)."""
    cached = pool.cached_block_hash_to_block
    return [b.block_id for b in pool.blocks
            if b.block_hash is not None and cached.contain(b.block_hash, b.block_id)]


def _shape(value: Any) -> Any:
    """Block ids replaced by their count (prefix caching off, plain_free_order listed)."""
    if isinstance(value, tuple):
        return tuple(_shape(v) for v in value)
    if isinstance(value, list):
        return len(value)
    return value


# --- running and shrinking ---------------------------------------------------------------

@dataclass
class Outcome:
    failure: str | None  # the divergence, or None
    at: int  # the index of the operation it happened at (len(ops) when none)
    listed: str | None = None  # the listed difference that ended the run early


def run(v: Any, ops: list[Op], caching: bool, num_blocks: int, allowed: set[str]) -> Outcome:
    state = Run(v, caching, num_blocks, allowed)
    for index, op in enumerate(ops):
        try:
            state.apply(op)
        except Listed as stop:
            return Outcome(None, index, stop.key)
        except Divergence as error:
            return Outcome(str(error), index)
    return Outcome(None, len(ops))


def shrink(v: Any, ops: list[Op], caching: bool, num_blocks: int, allowed: set[str]) -> list[Op]:
    """The shortest failing sequence found by cutting the tail, then deleting chunks and single
    operations while the run still fails (any divergence counts)."""
    def fails(candidate: list[Op]) -> bool:
        return run(v, candidate, caching, num_blocks, allowed).failure is not None

    first = run(v, ops, caching, num_blocks, allowed)
    ops = ops[:first.at + 1]
    chunk = max(1, len(ops) // 2)
    while chunk >= 1:
        i, changed = 0, False
        while i < len(ops):
            candidate = ops[:i] + ops[i + chunk:]
            if candidate and fails(candidate):
                ops, changed = candidate, True
            else:
                i += chunk
        if not changed:
            chunk //= 2
    return ops


def report(v: Any, ops: list[Op], caching: bool, num_blocks: int, allowed: set[str]) -> str:
    short = shrink(v, ops, caching, num_blocks, allowed)
    outcome = run(v, short, caching, num_blocks, allowed)
    steps = "\n".join(f"  {i}: {op}" for i, op in enumerate(short))
    return (f"prefix caching {'on' if caching else 'off'}, {num_blocks} blocks of {BLOCK_SIZE}: "
            f"shortest failing sequence ({len(short)} operations, fails at "
            f"{short[outcome.at]}):\n{steps}\n{outcome.failure}")
