"""The block pool and block tables (chapter 3): behaviours one by one, then stateful properties."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from minipaged.blocks import (
    BlockPool,
    BlockTable,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NoFreeBlocksError,
    bad_input_catalogue,
)


def queue_ids(pool):
    return [block.block_id for block in pool.free_block_queue]


def test_free_queue_take_return_and_remove_from_the_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 0]
    assert queue.num_free_blocks == len(queue) == 4


def test_free_queue_refuses_a_block_twice_or_a_missing_block():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError, match="block: block 1 is already in a free queue"):
        queue.append(blocks[1])
    taken = queue.popleft()
    with pytest.raises(ValueError, match="block: .* not in this free queue"):
        queue.remove(taken)
    for _ in range(2):
        queue.popleft()
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()


def test_free_queue_refuses_a_block_of_another_queue_and_keeps_both_counts():
    mine = FreeKVCacheBlockQueue(KVCacheBlock(i) for i in range(3))
    theirs = FreeKVCacheBlockQueue(KVCacheBlock(i) for i in range(3))
    stranger = list(theirs)[1]  # linked into theirs, with the same block_id as one of mine
    with pytest.raises(ValueError, match="block: .* not in this free queue"):
        mine.remove(stranger)
    assert [b.block_id for b in mine] == [0, 1, 2] and len(mine) == 3
    assert [b.block_id for b in theirs] == [0, 1, 2] and len(theirs) == 3
    with pytest.raises(ValueError, match="block: block 1 is already in a free queue"):
        mine.append(stranger)
    theirs.remove(stranger)  # its own queue may take it out, and then anyone may queue it
    mine.append(stranger)
    assert [len(mine), len(theirs)] == [4, 2] and list(mine)[-1] is stranger


@pytest.mark.parametrize("call, field, attempt", bad_input_catalogue(),
                         ids=[call for call, _, _ in bad_input_catalogue()])
def test_every_catalogued_mistake_is_a_value_error_naming_its_field(call, field, attempt):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        attempt()


@pytest.mark.parametrize("block_size", [0, -4, 3, 12, 2.0, True])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(num_blocks=4, block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 64])
def test_powers_of_two_are_accepted(block_size):
    assert BlockPool(num_blocks=4, block_size=block_size).block_size == block_size


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=16)


def test_allocate_hands_out_from_the_head_with_count_one():
    pool = BlockPool(num_blocks=6, block_size=16)
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 2
    assert pool.num_allocator_calls == 1


def test_a_refused_allocation_changes_nothing():
    pool = BlockPool(num_blocks=6, block_size=16)
    pool.get_new_blocks(4)
    before = (queue_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks but only 2"):
        pool.get_new_blocks(3)
    assert (queue_ids(pool), [b.ref_cnt for b in pool.blocks]) == before


def test_allocate_rejects_a_negative_count():
    pool = BlockPool(num_blocks=2, block_size=1)
    with pytest.raises(ValueError, match="n "):
        pool.get_new_blocks(-1)
    assert pool.num_allocator_calls == 0


def test_only_allocations_that_hand_out_blocks_are_counted():
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.get_new_blocks(0) == [] and pool.num_allocator_calls == 0
    pool.get_new_blocks(2)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1.0)
    assert pool.num_allocator_calls == 1
    pool.get_new_blocks(1)
    assert pool.num_allocator_calls == 2


def test_free_returns_blocks_to_the_tail_in_the_order_given():
    pool = BlockPool(num_blocks=5, block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks([blocks[2], blocks[0], blocks[1]])
    assert queue_ids(pool) == [3, 4, 2, 0, 1]


def test_shared_block_returns_only_when_its_last_owner_frees_it():
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks[:1])
    pool.free_blocks(blocks)
    assert blocks[0].ref_cnt == 1 and queue_ids(pool) == [2, 3, 1]
    pool.free_blocks(blocks[:1])
    assert queue_ids(pool) == [2, 3, 1, 0]


def test_touch_on_a_free_block_takes_it_out_of_the_middle_of_the_queue():
    pool = BlockPool(num_blocks=5, block_size=4)
    pool.touch([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1 and queue_ids(pool) == [0, 1, 3, 4]


def test_double_free_is_refused_whole():
    pool = BlockPool(num_blocks=3, block_size=4)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([blocks[0], blocks[1], blocks[1]])
    assert [b.ref_cnt for b in blocks] == [1, 1] and queue_ids(pool) == [2]


def test_touch_is_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="blocks: .*block_id=99.* not a block of this pool"):
        pool.touch([pool.blocks[1], KVCacheBlock(99)])
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 0] and queue_ids(pool) == [1, 2, 3]


@pytest.mark.parametrize("operation", ["free_blocks", "touch"])
def test_a_block_of_another_pool_is_refused_and_nothing_changes(operation):
    mine, theirs = BlockPool(num_blocks=2, block_size=4), BlockPool(num_blocks=2, block_size=4)
    own = mine.get_new_blocks(1)[0]
    stranger = theirs.get_new_blocks(1)[0]  # the same block_id, 0, but another pool's object
    with pytest.raises(ValueError, match="blocks: .* not a block of this pool"):
        getattr(mine, operation)([own, stranger])
    assert own.ref_cnt == 1 and queue_ids(mine) == [1] and mine.get_num_free_blocks() == 1
    assert stranger.ref_cnt == 1 and queue_ids(theirs) == [1]


def test_the_free_queue_s_sentinels_are_not_blocks_of_the_pool():
    pool = BlockPool(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="blocks"):
        pool.touch([pool.free_block_queue.fake_free_list_head])


def test_table_grows_by_the_difference_in_one_call():
    pool = BlockPool(num_blocks=10, block_size=4)
    table = BlockTable(pool)
    assert table.ensure_capacity(5) == 2
    assert [table.ensure_capacity(n) for n in (6, 7, 8, 9)] == [0, 0, 0, 1]
    assert pool.num_allocator_calls == 2
    assert table.ensure_capacity(21) == 3 and pool.num_allocator_calls == 3
    assert table.block_ids == [0, 1, 2, 3, 4, 5]
    assert table.blocks_needed(3) == 0 and table.blocks_needed(25) == 1


def test_decode_of_2048_tokens_calls_the_allocator_once_per_block():
    pool = BlockPool(num_blocks=200, block_size=16)
    table = BlockTable(pool)
    for length in range(1, 2049):
        table.ensure_capacity(length)
    assert pool.num_allocator_calls == 128 == len(table.blocks)


def test_slot_is_block_times_size_plus_offset():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.get_new_blocks(3)  # so that the table's blocks are not 0, 1, 2
    table = BlockTable(pool)
    table.ensure_capacity(10)
    ids = table.block_ids
    assert ids == [3, 4, 5]
    assert table.slot_mapping(0, 10) == [ids[p // 4] * 4 + p % 4 for p in range(10)]
    assert table.slot(9) == 21
    with pytest.raises(ValueError, match="position 12"):
        table.slot(12)
    with pytest.raises(ValueError, match="end=13"):
        table.slot_mapping(0, 13)


@pytest.mark.parametrize("position", [1.5, True, -1, "3", None])
def test_slot_refuses_a_position_that_is_not_a_count(position):
    table = BlockTable(BlockPool(num_blocks=4, block_size=4))
    table.ensure_capacity(8)
    with pytest.raises(ValueError, match="position"):
        table.slot(position)


@pytest.mark.parametrize(("start", "end", "name"), [(0.0, 2, "start"), (0, True, "end"),
                                                    (-1, 2, "start"), (0, 2.5, "end")])
def test_slot_mapping_refuses_bounds_that_are_not_counts(start, end, name):
    table = BlockTable(BlockPool(num_blocks=4, block_size=4))
    table.ensure_capacity(8)
    with pytest.raises(ValueError, match=name):
        table.slot_mapping(start, end)


def test_numpy_positions_give_plain_int_slots():
    np = pytest.importorskip("numpy")
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.get_new_blocks(1)
    table = BlockTable(pool)
    table.ensure_capacity(8)
    assert table.slot(np.int64(5)) == 9 and type(table.slot(np.int64(5))) is int
    mapping = table.slot_mapping(np.int64(3), np.int64(6))
    assert mapping == [7, 8, 9] and all(type(slot) is int for slot in mapping)


def test_refused_growth_leaves_the_table_unchanged():
    pool = BlockPool(num_blocks=4, block_size=2)
    other = BlockTable(pool)
    other.ensure_capacity(4)
    table = BlockTable(pool)
    table.ensure_capacity(2)
    with pytest.raises(NoFreeBlocksError):
        table.ensure_capacity(6)
    assert table.block_ids == [2] and pool.get_num_free_blocks() == 1


def test_a_table_longer_than_the_pool_is_a_value_error():
    table = BlockTable(BlockPool(num_blocks=4, block_size=2))
    with pytest.raises(ValueError, match="num_tokens=9"):
        table.ensure_capacity(9)
    with pytest.raises(ValueError, match="num_tokens"):
        table.ensure_capacity(-1)


def test_table_free_returns_blocks_last_first_and_empties():
    pool = BlockPool(num_blocks=5, block_size=2)
    table = BlockTable(pool)
    table.ensure_capacity(6)
    table.free()
    assert table.blocks == [] and queue_ids(pool) == [3, 4, 2, 1, 0]


def test_a_finished_sequence_s_last_block_is_the_first_reused():
    # vLLM frees a request's blocks reversed, so its tail is evicted before its prefix
    pool = BlockPool(num_blocks=3, block_size=2)
    table = BlockTable(pool)
    table.ensure_capacity(6)  # blocks 0, 1, 2: the whole pool
    table.free()
    assert [block.block_id for block in pool.get_new_blocks(3)] == [2, 1, 0]


def test_share_points_a_second_table_at_the_same_blocks():
    pool = BlockPool(num_blocks=6, block_size=2)
    parent, child = BlockTable(pool), BlockTable(pool)
    parent.ensure_capacity(5)
    child.share(parent.blocks[:2])
    child.ensure_capacity(6)
    assert child.block_ids[:2] == parent.block_ids[:2]
    assert [b.ref_cnt for b in parent.blocks] == [2, 2, 1]
    parent.free()
    child.free()
    assert pool.get_num_free_blocks() == 6


# ---------------------------------------------------------------------------------------------
# Stateful: random allocate / grow / share / free across many sequences, invariants every step.


class PoolMachine(RuleBasedStateMachine):
    """A pool of 24 blocks of 4 serving sequences that grow, share prefixes and finish."""

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=24, block_size=4)
        self.live: list[BlockTable] = []

    @rule(target=tables, num_tokens=st.integers(0, 40))
    def start(self, num_tokens):
        table = BlockTable(self.pool)
        self._grow(table, num_tokens)
        self.live.append(table)
        return table

    @rule(table=tables, extra=st.integers(0, 20))
    def grow(self, table, extra):
        if table in self.live:
            self._grow(table, table.capacity + extra)

    @rule(target=tables, parent=tables, num_blocks=st.integers(0, 6), num_tokens=st.integers(0, 40))
    def fork(self, parent, num_blocks, num_tokens):
        child = BlockTable(self.pool)
        if parent in self.live:
            child.share(parent.blocks[:num_blocks])
        self._grow(child, num_tokens)
        self.live.append(child)
        return child

    @rule(target=tables, start=st.integers(0, 23), num_blocks=st.integers(1, 4))
    def claim_free_blocks(self, start, num_blocks):
        # a prefix-cache hit on free blocks: taken from the middle of the free queue
        table = BlockTable(self.pool)
        table.share(list(self.pool.free_block_queue)[start:start + num_blocks])
        self.live.append(table)
        return table

    @rule(table=tables, stranger_id=st.integers(0, 23),
          operation=st.sampled_from(["touch", "free_blocks"]))
    def refuse_a_stranger(self, table, stranger_id, operation):
        # a block of another pool among this pool's own: refused whole, nothing changes
        before = ([b.ref_cnt for b in self.pool.blocks], list(self.pool.free_block_queue))
        stranger = BlockPool(num_blocks=24, block_size=4).blocks[stranger_id]
        with pytest.raises(ValueError, match="not a block of this pool"):
            getattr(self.pool, operation)(table.blocks + [stranger])
        assert ([b.ref_cnt for b in self.pool.blocks], list(self.pool.free_block_queue)) == before

    @rule(table=consumes(tables))
    def finish(self, table):
        if table in self.live:
            table.free()
            self.live.remove(table)
            assert table.blocks == []

    def _grow(self, table, num_tokens):
        before = (table.block_ids, self.pool.get_num_free_blocks(), self.pool.num_allocator_calls)
        needed = table.blocks_needed(num_tokens)
        try:
            assert table.ensure_capacity(num_tokens) == needed
        except (NoFreeBlocksError, ValueError):
            # refused: nothing changed, not even the count of calls
            assert (table.block_ids, self.pool.get_num_free_blocks(),
                    self.pool.num_allocator_calls) == before
            return
        assert table.capacity >= num_tokens
        assert self.pool.num_allocator_calls - before[2] == (1 if needed else 0)

    @invariant()
    def free_exactly_when_count_is_zero(self):
        queued = [block.block_id for block in self.pool.free_block_queue]
        assert len(queued) == len(set(queued)) == self.pool.get_num_free_blocks()
        assert set(queued) == {b.block_id for b in self.pool.blocks if b.ref_cnt == 0}

    @invariant()
    def counts_match_the_tables(self):
        holders = [0] * self.pool.num_blocks
        for table in self.live:
            for block_id in table.block_ids:
                holders[block_id] += 1
        assert holders == [block.ref_cnt for block in self.pool.blocks]
        held = sum(1 for count in holders if count)
        assert held + self.pool.get_num_free_blocks() == self.pool.num_blocks

    @invariant()
    def queue_links_agree_both_ways(self):
        forward = list(self.pool.free_block_queue)
        backward, block = [], self.pool.free_block_queue.fake_free_list_tail.prev_free_block
        while block is not self.pool.free_block_queue.fake_free_list_head:
            backward.append(block)
            block = block.prev_free_block
        assert forward == backward[::-1]

    def teardown(self):
        for table in self.live:
            table.free()
        assert self.pool.get_num_free_blocks() == self.pool.num_blocks
        assert all(block.ref_cnt == 0 for block in self.pool.blocks)
        ids = [block.block_id for block in self.pool.free_block_queue]
        assert sorted(ids) == list(range(self.pool.num_blocks))
        self.pool.get_new_blocks(self.pool.num_blocks)  # the whole pool can be handed out again


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.pytestmark = [pytest.mark.heavy]  # a stateful search: over a second


# ---------------------------------------------------------------------------------------------
# The fast paths: popleft_n and append_n on the queue, and the pool and tables built on them.


def test_popleft_n_takes_the_head_in_order_and_leaves_the_rest_linked():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    for n, expected in [(1, [0]), (3, [1, 2, 3]), (0, [])]:
        assert queue.popleft_n(n) == [blocks[i] for i in expected]
    assert [b.block_id for b in queue] == [4, 5] and len(queue) == 2
    assert all(b.prev_free_block is b.next_free_block is b.free_queue is None
               for b in blocks[:4])
    assert queue.fake_free_list_head.next_free_block is blocks[4]
    assert blocks[4].prev_free_block is queue.fake_free_list_head


def test_popleft_n_refuses_more_than_are_free_and_changes_nothing():
    blocks = [KVCacheBlock(i) for i in range(3)]
    queue = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(NoFreeBlocksError, match="asked for 4 blocks but only 3"):
        queue.popleft_n(4)
    assert [b.block_id for b in queue] == [0, 1, 2] and len(queue) == 3
    assert queue.popleft_n(3) == blocks and len(queue) == 0
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail


def test_append_n_puts_blocks_at_the_tail_in_the_order_given():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks[:2])
    queue.append_n([blocks[4], blocks[2], blocks[3]])
    queue.append_n([])
    assert [b.block_id for b in queue] == [0, 1, 4, 2, 3] and len(queue) == 5
    assert all(b.free_queue is queue for b in blocks)
    backward, block = [], queue.fake_free_list_tail.prev_free_block
    while block is not queue.fake_free_list_head:
        backward.append(block.block_id)
        block = block.prev_free_block
    assert backward == [3, 2, 4, 1, 0]


def test_numpy_counts_are_taken_as_plain_ones():
    np = pytest.importorskip("numpy")
    pool = BlockPool(num_blocks=4, block_size=4)
    assert [b.block_id for b in pool.get_new_blocks(np.int64(2))] == [0, 1]
    table = BlockTable(pool)
    assert table.ensure_capacity(np.int32(5)) == 2 and table.block_ids == [2, 3]


@pytest.mark.parametrize("num_tokens", [1.0, True, "8", None, -3])
def test_ensure_capacity_refuses_a_count_and_changes_nothing(num_tokens):
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(4)
    with pytest.raises(ValueError, match="num_tokens"):
        table.ensure_capacity(num_tokens)
    assert table.block_ids == [0] and queue_ids(pool) == [1, 2, 3]
    assert pool.num_allocator_calls == 1


class ReferencePoolMachine(RuleBasedStateMachine):
    """The pool against a reference of plain lists (a deque of free ids, as nano-vllm keeps
    them): every operation, through a table's unchecked paths or the pool's checked ones, must
    leave the same free order and the same counts."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=4)
        self.free_ids = list(range(12))  # the reference free queue, head first
        self.counts = [0] * 12
        self.tables: list[BlockTable] = []
        self.loose: list[list] = []  # blocks held through pool.get_new_blocks, not by a table

    def _take(self, n):
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        for block_id in taken:
            self.counts[block_id] = 1
        return taken

    def _give_back(self, block_ids):
        for block_id in block_ids:
            self.counts[block_id] -= 1
            if self.counts[block_id] == 0:
                self.free_ids.append(block_id)

    @rule(num_tokens=st.integers(0, 24))
    def new_table(self, num_tokens):
        table, needed = BlockTable(self.pool), -(-num_tokens // 4)
        if needed > len(self.free_ids):
            with pytest.raises(NoFreeBlocksError):
                table.ensure_capacity(num_tokens)
            assert table.blocks == []
            return
        assert table.ensure_capacity(num_tokens) == needed
        assert table.block_ids == self._take(needed)
        self.tables.append(table)

    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow(self, data, extra):
        if not self.tables:
            return
        table = data.draw(st.sampled_from(self.tables))
        num_tokens = table.capacity + extra
        needed = -(-num_tokens // 4) - len(table.blocks)
        if needed > len(self.free_ids) or len(table.blocks) + needed > 12:
            with pytest.raises((NoFreeBlocksError, ValueError)):
                table.ensure_capacity(num_tokens)
            return
        before = table.block_ids
        table.ensure_capacity(num_tokens)
        assert table.block_ids == before + self._take(needed)

    @rule(data=st.data())
    def hit_on_a_free_block(self, data):
        # a prefix-cache hit: a block taken out of the middle of the free queue by a table
        if not self.free_ids:
            return
        block_id = data.draw(st.sampled_from(self.free_ids))
        table = BlockTable(self.pool)
        table.share([self.pool.blocks[block_id]])
        self.free_ids.remove(block_id)
        self.counts[block_id] += 1
        self.tables.append(table)

    @rule(data=st.data())
    def share_held_blocks(self, data):
        if not self.tables:
            return
        parent = data.draw(st.sampled_from(self.tables))
        child = BlockTable(self.pool)
        child.share(parent.blocks)
        for block_id in parent.block_ids:
            self.counts[block_id] += 1
        self.tables.append(child)

    @rule(data=st.data())
    def finish_table(self, data):
        if not self.tables:
            return
        table = data.draw(st.sampled_from(self.tables))
        self.tables.remove(table)
        block_ids = table.block_ids
        table.free()  # the unchecked path: last block first
        self._give_back(block_ids[::-1])

    @rule(n=st.integers(0, 5))
    def allocate_loose(self, n):
        if n > len(self.free_ids):
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(n)
            return
        blocks = self.pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == self._take(n)
        self.loose.append(blocks)

    @rule(data=st.data())
    def free_loose(self, data):
        # the checked path, in an order of the caller's choosing
        if not self.loose:
            return
        blocks = data.draw(st.sampled_from(self.loose))
        self.loose.remove(blocks)
        order = data.draw(st.permutations(blocks))
        self.pool.free_blocks(order)
        self._give_back([b.block_id for b in order])

    @invariant()
    def same_free_order_and_counts(self):
        assert queue_ids(self.pool) == self.free_ids
        assert self.pool.get_num_free_blocks() == len(self.free_ids)
        assert [b.ref_cnt for b in self.pool.blocks] == self.counts

    @invariant()
    def links_agree_both_ways(self):
        queue = self.pool.free_block_queue
        backward, block = [], queue.fake_free_list_tail.prev_free_block
        while block is not queue.fake_free_list_head:
            backward.append(block.block_id)
            block = block.prev_free_block
        assert backward[::-1] == self.free_ids
        assert all((b.free_queue is queue) == (b.ref_cnt == 0) for b in self.pool.blocks)


ReferencePoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                  deadline=None)
TestReferencePoolMachine = ReferencePoolMachine.TestCase
TestReferencePoolMachine.pytestmark = [pytest.mark.heavy]  # a stateful search: over a second


def test_a_double_free_through_two_ways_in_is_refused_before_any_count_changes():
    # pool.free_blocks(table.blocks), then table.free(): the table's light path must not drive a
    # count below zero (which would let the pool hand a still-shared block to a new owner)
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.ensure_capacity(8)
    other = BlockTable(pool)
    other.share(table.blocks[:1])  # block 0 held twice, block 1 once
    pool.free_blocks(table.blocks)
    before = [b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue]
    with pytest.raises(ValueError, match="freed more often than held"):
        table.free()
    assert ([b.ref_cnt for b in pool.blocks], [b.block_id for b in pool.free_block_queue]) == before


def test_get_new_blocks_names_its_count_when_refusing_one():
    pool = BlockPool(num_blocks=4, block_size=4)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="num_blocks"):
            pool.get_new_blocks(bad)
    assert pool.get_num_free_blocks() == 4
