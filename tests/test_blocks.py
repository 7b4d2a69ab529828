"""The block pool and block tables (chapter 3): behaviours one by one, then stateful properties."""
import pytest

from minipaged.blocks import (
    BlockPool,
    BlockTable,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    NoFreeBlocksError,
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
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[1])
    taken = queue.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(taken)
    for _ in range(2):
        queue.popleft()
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()


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
    blocks = pool.allocate(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 2
    assert pool.num_allocator_calls == 1


def test_a_refused_allocation_changes_nothing():
    pool = BlockPool(num_blocks=6, block_size=16)
    pool.allocate(4)
    before = (queue_ids(pool), [b.ref_cnt for b in pool.blocks])
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks but only 2"):
        pool.allocate(3)
    assert (queue_ids(pool), [b.ref_cnt for b in pool.blocks]) == before


def test_allocate_rejects_a_negative_count():
    with pytest.raises(ValueError, match="n "):
        BlockPool(num_blocks=2, block_size=1).allocate(-1)


def test_free_returns_blocks_to_the_tail_in_the_order_given():
    pool = BlockPool(num_blocks=5, block_size=4)
    blocks = pool.allocate(3)
    pool.free([blocks[2], blocks[0], blocks[1]])
    assert queue_ids(pool) == [3, 4, 2, 0, 1]


def test_shared_block_returns_only_when_its_last_owner_frees_it():
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.incref(blocks[:1])
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1 and queue_ids(pool) == [2, 3, 1]
    pool.free(blocks[:1])
    assert queue_ids(pool) == [2, 3, 1, 0]


def test_incref_on_a_free_block_takes_it_out_of_the_middle_of_the_queue():
    pool = BlockPool(num_blocks=5, block_size=4)
    pool.incref([pool.blocks[2]])
    assert pool.blocks[2].ref_cnt == 1 and queue_ids(pool) == [0, 1, 3, 4]


def test_double_free_is_refused_whole():
    pool = BlockPool(num_blocks=3, block_size=4)
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([blocks[0], blocks[1], blocks[1]])
    assert [b.ref_cnt for b in blocks] == [1, 1] and queue_ids(pool) == [2]


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
    pool.allocate(3)  # so that the table's blocks are not 0, 1, 2
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
