"""Block bookkeeping against nano-vllm's BlockManager: time per operation, 1k to 1M blocks.

minipaged's side is chapter 3's pool and block tables and chapter 7's KVCacheManager (and, for
the decode step the engine takes by default, chapter 8's PrefixCachingKVCacheManager).

The peer. nano-vllm (github.com/GeeeekExplorer/nano-vllm) is not on the package registries, so
NanoBlockManager below is a reimplementation of its BlockManager
(nanovllm/engine/block_manager.py), rebuilt from its public design: a list of Block objects,
a deque of free block ids, a set of used ids, a dict from block hash to block id, and
`deque.remove(block_id)` to take a block out of the free queue (found at once when the block is
the head, a scan when a prefix-cache hit picks one from the middle). Blocks hold 256 tokens, as
in nano-vllm's config (kvcache_block_size), and minipaged's pools use 256 too, so that both sides
see the same block counts.

Content hashing is left out on both sides: nano-vllm hashes every full block with xxhash (and
compares the tokens of a hit), minipaged's prefix cache uses SHA-256, and neither is
bookkeeping. The peer's allocate takes the path nano-vllm takes for a block that is not full
(no hash), its decode stream finds the hash of a filled block already set, and minipaged's
plain KVCacheManager hashes nothing.

The operation streams (drawn once per pool size from a fixed seed, replayed by every side):
- churn: admit a sequence of 1 to 2,048 tokens (1 to 8 blocks) and release the oldest one
  still held, with about half the pool held throughout; one operation is one admission and one
  release. Peer: can_allocate + allocate, deallocate. KVCacheManager: allocate_slots (which
  checks the free count itself and returns None when short), free. BlockTable: a new table,
  ensure_capacity, free.
- decode step: room for one more token in a last block that has room (nothing to allocate),
  cycling over a quarter as many sequences as the pool has blocks, at most 10,000.
  Peer: can_append + may_append. minipaged: allocate_slots(request, 1), or ensure_capacity.
- decode growth: room for one more token that starts a new block (one block appended). The
  same calls; between passes, outside the timing, every sequence is moved to its next
  boundary.
- hit on a free block: find a cached block by its hash, take it out of the free queue from
  wherever it is, then give it back. Peer: the hit branch of allocate (dict lookup,
  _allocate_block with deque.remove, the hash written back) and the release branch of
  deallocate. minipaged: PrefixCachingBlockPool.get_cached_block, touch, free_blocks.

The CSV's columns: the operation, the pool size, the side, how many sequences the stream holds
at once (churn holds about half the pool, so over a hundred thousand sequences at 1M blocks),
the repeats, the operations timed per repeat, and the min and median nanoseconds per operation.

Each repeat runs every side once, in alternating order, on a freshly built state (building is
not timed; the garbage collector is off while timing). The clock is the process's CPU time
(time.process_time), because the machine the book is built on shares two cores among several
processes and wall time would count their turns too. Reported: min and median over repeats of
nanoseconds per operation, over 7 repeats (3 at 1M blocks, where the peer's hits take
milliseconds each). Written to bench/results/blocks.csv and printed; never asserted.
Run it with `python -m bench.blocks` (`--quick` stops at 100k blocks and writes no CSV).
"""
from __future__ import annotations

import argparse
import csv
import gc
import itertools
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from minipaged.blocks import BlockPool, BlockTable
from minipaged.prefix_cache import PrefixCachingBlockPool, PrefixCachingKVCacheManager
from minipaged.sampling import SamplingParams
from minipaged.scheduler import KVCacheManager, Request

RESULTS = Path(__file__).resolve().parent / "results" / "blocks.csv"
SIZES = [1_000, 10_000, 100_000, 1_000_000]
BLOCK_SIZE = 256  # nano-vllm's kvcache_block_size
OPERATIONS = 20_000  # timed operations per side per repeat (hits: fewer, see hit_count)
MAX_TOKENS = 2_048  # churn: sequences of 1 to 2,048 tokens, 1 to 8 blocks
PEER = "nano-vllm BlockManager (rebuilt)"


# ------------------------------------------------------------------------------------------
# The peer: nano-vllm's Block, the fields of its Sequence that BlockManager reads, BlockManager.


class NanoBlock:
    """nano-vllm's Block: an id, a reference count, a hash (-1 for none) and its tokens."""

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, hash: int, token_ids: list[int]) -> None:  # noqa: A002 (nano-vllm's name)
        self.hash = hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class NanoSequence:
    """nano-vllm's Sequence: its fields (so that it weighs what it weighs there), its length,
    its block count. Its token list is a stand-in one token long, as is minipaged's Request in
    these streams: neither side's bookkeeping reads the tokens once hashing is left out."""

    block_size = BLOCK_SIZE
    counter = itertools.count()

    def __init__(self, num_tokens: int, token_ids: list[int] | None = None) -> None:
        self.seq_id = next(NanoSequence.counter)
        self.status = "WAITING"
        self.token_ids = list(token_ids or [0])
        self.last_token = self.token_ids[-1]
        self.num_tokens = num_tokens
        self.num_prompt_tokens = num_tokens
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.temperature, self.max_tokens, self.ignore_eos = 1.0, 64, False

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size


class NanoBlockManager:
    """nano-vllm's BlockManager, rebuilt, with content hashing left out (see the docstring)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: list[NanoBlock] = [NanoBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    def _allocate_block(self, block_id: int) -> NanoBlock:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return self.blocks[block_id]

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: NanoSequence) -> None:
        assert not seq.block_table
        cache_miss = False
        for _ in range(seq.num_blocks):
            h = -1  # nano-vllm hashes a full block here; left out (the path of a partial block)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += self.block_size
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.update(h, [])
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)

    def deallocate(self, seq: NanoSequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: NanoSequence) -> bool:
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: NanoSequence) -> None:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        if len(seq) % self.block_size == 1:
            assert last_block.hash != -1
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            block_table.append(block_id)
        elif len(seq) % self.block_size == 0:
            # nano-vllm hashes the block that just filled here; the streams never time this step
            assert last_block.hash == -1
            last_block.update(len(block_table), [])
            self.hash_to_block_id[len(block_table)] = last_block.block_id
        else:
            assert last_block.hash == -1

    def hit(self, h: int) -> int:
        """The cache-hit branch of allocate, for one block found by its hash h."""
        block_id = self.hash_to_block_id.get(h, -1)
        if block_id in self.used_block_ids:
            block = self.blocks[block_id]
            block.ref_count += 1
        else:
            block = self._allocate_block(block_id)
        block.update(h, [])  # _allocate_block reset it; allocate writes the hash back
        self.hash_to_block_id[h] = block_id
        return block_id

    def release(self, block_id: int) -> None:
        """The branch of deallocate for one block."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._deallocate_block(block_id)


# ------------------------------------------------------------------------------------------
# The harness: a side builds its state (not timed) and runs the stream (timed).


def timed(run: Callable[[], int]) -> tuple[float, int]:
    """CPU seconds and operation count of run(), with the garbage collector off.

    The clock is the process's CPU time, not the wall clock: on a machine whose cores other
    processes share, wall time also counts the moments they held the core."""
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        count = run()
        return time.process_time() - start, count
    finally:
        gc.enable()


def request(name: str, num_tokens: int = 1) -> Request:
    return Request(name, [0] * num_tokens, SamplingParams())


# --- churn -----------------------------------------------------------------------------------


def churn_stream(num_blocks: int, rng: random.Random) -> tuple[int, list[int]]:
    """The window (sequences held at once, about half the pool) and every admission's length."""
    window = num_blocks // 9  # lengths average 4.5 blocks: half the pool held
    return window, [rng.randint(1, MAX_TOKENS) for _ in range(window + OPERATIONS)]


def churn_peer(num_blocks: int, window: int, lengths: list[int]) -> tuple[float, int]:
    manager = NanoBlockManager(num_blocks, BLOCK_SIZE)
    seqs = [NanoSequence(length) for length in lengths]
    for seq in seqs[:window]:
        manager.allocate(seq)

    def run() -> int:
        can_allocate, allocate, deallocate = (manager.can_allocate, manager.allocate,
                                              manager.deallocate)
        for oldest, seq in zip(seqs, seqs[window:]):
            if not can_allocate(seq):
                raise RuntimeError("the churn stream overfilled the pool")
            allocate(seq)
            deallocate(oldest)
        return OPERATIONS

    return timed(run)


def churn_manager(num_blocks: int, window: int, lengths: list[int]) -> tuple[float, int]:
    manager = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE))
    requests = [request(str(i)) for i in range(len(lengths))]
    for req, length in zip(requests[:window], lengths):
        manager.allocate_slots(req, length)

    def run() -> int:
        allocate_slots, free = manager.allocate_slots, manager.free
        for oldest, req, length in zip(requests, requests[window:], lengths[window:]):
            if allocate_slots(req, length) is None:
                raise RuntimeError("the churn stream overfilled the pool")
            free(oldest)
        return OPERATIONS

    return timed(run)


def churn_table(num_blocks: int, window: int, lengths: list[int]) -> tuple[float, int]:
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    tables = [BlockTable(pool) for _ in range(window)]
    for table, length in zip(tables, lengths):
        table.ensure_capacity(length)

    def run() -> int:
        held = deque(tables)
        for length in lengths[window:]:
            table = BlockTable(pool)
            table.ensure_capacity(length)
            held.append(table)
            held.popleft().free()
        return OPERATIONS

    return timed(run)


# --- decode: a step with room, and a step that crosses into a new block ---------------------


def decode_sequences(num_blocks: int) -> int:
    return min(num_blocks // 4, 10_000)


def cycle(items: list, count: int) -> list:
    return (items * (count // len(items) + 1))[:count]


def step_peer(num_blocks: int) -> tuple[float, int]:
    manager = NanoBlockManager(num_blocks, BLOCK_SIZE)
    seqs = [NanoSequence(5, [0] * 5) for _ in range(decode_sequences(num_blocks))]
    for seq in seqs:
        manager.allocate(seq)
    order = cycle(seqs, OPERATIONS)

    def run() -> int:
        can_append, may_append = manager.can_append, manager.may_append
        for seq in order:
            if not can_append(seq):
                raise RuntimeError("no room")
            may_append(seq)
        return len(order)

    return timed(run)


def step_manager(num_blocks: int, manager_class=KVCacheManager) -> tuple[float, int]:
    manager = manager_class(manager_class.pool_class(num_blocks, BLOCK_SIZE))
    requests = [request(str(i), 5) for i in range(decode_sequences(num_blocks))]
    for req in requests:
        manager.allocate_slots(req, 4)
        req.num_computed_tokens = 4  # the fifth token is the one each step makes room for
    order = cycle(requests, OPERATIONS)

    def run() -> int:
        allocate_slots = manager.allocate_slots
        for req in order:
            if allocate_slots(req, 1) is None:
                raise RuntimeError("no room")
        return len(order)

    return timed(run)


def step_prefix_manager(num_blocks: int) -> tuple[float, int]:
    return step_manager(num_blocks, PrefixCachingKVCacheManager)


def step_table(num_blocks: int) -> tuple[float, int]:
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    tables = [BlockTable(pool) for _ in range(decode_sequences(num_blocks))]
    for table in tables:
        table.ensure_capacity(4)
    order = cycle(tables, OPERATIONS)

    def run() -> int:
        for table in order:
            table.ensure_capacity(5)
        return len(order)

    return timed(run)


PASSES = 3  # growth: every sequence crosses PASSES boundaries in a round


def rounds(num_blocks: int) -> int:
    """Rounds of growth (each on a fresh state) that make at least OPERATIONS crossings."""
    return -(-OPERATIONS // (decode_sequences(num_blocks) * PASSES))


def growth(num_blocks: int, one_round: Callable[[int], tuple[float, int]]) -> tuple[float, int]:
    """Seconds and crossings of every round together."""
    totals = [one_round(num_blocks) for _ in range(rounds(num_blocks))]
    return sum(seconds for seconds, _ in totals), sum(count for _, count in totals)


def growth_peer_round(num_blocks: int) -> tuple[float, int]:
    manager = NanoBlockManager(num_blocks, BLOCK_SIZE)
    seqs = [NanoSequence(BLOCK_SIZE) for _ in range(decode_sequences(num_blocks))]
    for seq in seqs:
        manager.allocate(seq)
        manager.blocks[seq.block_table[-1]].hash = 0  # as if hashed when it filled
        seq.num_tokens += 1  # the token that needs a new block

    def run() -> int:
        can_append, may_append = manager.can_append, manager.may_append
        for seq in seqs:
            if not can_append(seq):
                raise RuntimeError("no room")
            may_append(seq)
        return len(seqs)

    seconds = count = 0
    for _ in range(PASSES):
        elapsed, done = timed(run)
        seconds, count = seconds + elapsed, count + done
        for seq in seqs:  # to the next boundary, its last block filled and hashed
            manager.blocks[seq.block_table[-1]].hash = 0
            seq.num_tokens += BLOCK_SIZE
    return seconds, count


def growth_manager_round(num_blocks: int) -> tuple[float, int]:
    manager = KVCacheManager(BlockPool(num_blocks, BLOCK_SIZE))
    requests = [request(str(i)) for i in range(decode_sequences(num_blocks))]
    for req in requests:
        manager.allocate_slots(req, BLOCK_SIZE)
        req.num_computed_tokens = BLOCK_SIZE  # full: the next token needs a new block

    def run() -> int:
        allocate_slots = manager.allocate_slots
        for req in requests:
            if allocate_slots(req, 1) is None:
                raise RuntimeError("no room")
        return len(requests)

    seconds = count = 0
    for _ in range(PASSES):
        elapsed, done = timed(run)
        seconds, count = seconds + elapsed, count + done
        for req in requests:
            req.num_computed_tokens += BLOCK_SIZE
    return seconds, count


def growth_table_round(num_blocks: int) -> tuple[float, int]:
    pool = BlockPool(num_blocks, BLOCK_SIZE)
    tables = [BlockTable(pool) for _ in range(decode_sequences(num_blocks))]
    for table in tables:
        table.ensure_capacity(BLOCK_SIZE)
    boundary = [BLOCK_SIZE]

    def run() -> int:
        num_tokens = boundary[0] + 1
        for table in tables:
            table.ensure_capacity(num_tokens)
        return len(tables)

    seconds = count = 0
    for _ in range(PASSES):
        elapsed, done = timed(run)
        seconds, count = seconds + elapsed, count + done
        boundary[0] += BLOCK_SIZE
    return seconds, count


def growth_peer(num_blocks: int) -> tuple[float, int]:
    return growth(num_blocks, growth_peer_round)


def growth_manager(num_blocks: int) -> tuple[float, int]:
    return growth(num_blocks, growth_manager_round)


def growth_table(num_blocks: int) -> tuple[float, int]:
    return growth(num_blocks, growth_table_round)


# --- hits on free cached blocks ----------------------------------------------------------------


def hit_count(num_blocks: int) -> int:
    """Fewer hits in large pools: the peer's deque.remove scans, about a millisecond at 1M."""
    return max(100, min(2_000, 20_000_000 // num_blocks))


def hit_stream(num_blocks: int, rng: random.Random) -> list[int]:
    return [rng.randrange(num_blocks) for _ in range(hit_count(num_blocks))]


def hit_peer(num_blocks: int, victims: list[int]) -> tuple[float, int]:
    manager = NanoBlockManager(num_blocks, BLOCK_SIZE)
    for block in manager.blocks:  # every block cached and free
        block.hash = block.block_id
        manager.hash_to_block_id[block.block_id] = block.block_id

    def run() -> int:
        hit, release = manager.hit, manager.release
        for h in victims:
            release(hit(h))
        return len(victims)

    return timed(run)


def hit_pool(num_blocks: int, victims: list[int]) -> tuple[float, int]:
    pool = PrefixCachingBlockPool(num_blocks, BLOCK_SIZE)
    hashes = [i.to_bytes(32, "little") for i in range(num_blocks)]
    pool.cache_full_blocks(pool.blocks, hashes, 0, num_blocks)
    keys = [hashes[i] for i in victims]

    def run() -> int:
        get_cached_block, touch, free_blocks = (pool.get_cached_block, pool.touch,
                                                pool.free_blocks)
        for block_hash in keys:
            block = [get_cached_block(block_hash)]
            touch(block)
            free_blocks(block)
        return len(keys)

    return timed(run)


# ------------------------------------------------------------------------------------------


def measure(num_blocks: int, repeats: int, rng: random.Random) -> list[dict]:
    window, lengths = churn_stream(num_blocks, rng)
    victims = hit_stream(num_blocks, rng)
    operations = {
        "churn": {PEER: lambda: churn_peer(num_blocks, window, lengths),
                  "minipaged KVCacheManager": lambda: churn_manager(num_blocks, window, lengths),
                  "minipaged BlockTable": lambda: churn_table(num_blocks, window, lengths)},
        "decode step": {PEER: lambda: step_peer(num_blocks),
                        "minipaged KVCacheManager": lambda: step_manager(num_blocks),
                        "minipaged PrefixCachingKVCacheManager":
                            lambda: step_prefix_manager(num_blocks),
                        "minipaged BlockTable": lambda: step_table(num_blocks)},
        "decode growth": {PEER: lambda: growth_peer(num_blocks),
                          "minipaged KVCacheManager": lambda: growth_manager(num_blocks),
                          "minipaged BlockTable": lambda: growth_table(num_blocks)},
        "hit on a free block": {PEER: lambda: hit_peer(num_blocks, victims),
                                "minipaged PrefixCachingBlockPool":
                                    lambda: hit_pool(num_blocks, victims)},
    }
    held = {"churn": window, "decode step": decode_sequences(num_blocks),
            "decode growth": decode_sequences(num_blocks), "hit on a free block": 0}
    rows = []
    for operation, sides in operations.items():
        samples: dict[str, list[float]] = {side: [] for side in sides}
        counts: dict[str, int] = {}
        for repeat in range(repeats):
            order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]  # take turns
            for side in order:
                seconds, counts[side] = sides[side]()
                samples[side].append(1e9 * seconds / counts[side])
        for side, values in samples.items():
            rows.append({"operation": operation, "num_blocks": num_blocks, "side": side,
                         "sequences": held[operation], "repeats": repeats,
                         "operations": counts[side],
                         "min_ns": round(min(values), 1),
                         "median_ns": round(statistics.median(values), 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stop at 100k blocks")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for num_blocks in SIZES[:3] if args.quick else SIZES:
        repeats = args.repeats if num_blocks < 1_000_000 else max(3, args.repeats // 2)
        measured = measure(num_blocks, repeats, random.Random(num_blocks))
        rows += measured
        for row in measured:
            print(f"{row['operation']:>20} {row['num_blocks']:>9,} {row['side']:>38} "
                  f"min {row['min_ns']:>10,.1f} ns  median {row['median_ns']:>10,.1f} ns",
                  flush=True)
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
