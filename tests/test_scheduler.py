"""The scheduler alone, driven by a stand-in model: budget, admission, growth, preemption."""
import pytest

import minipaged.scheduler as scheduler_module
from minipaged.blocks import BlockPool, BlockTable
from minipaged.frontend import FrontEndArgs
from minipaged.sampling import SamplingParams
from minipaged.scheduler import (
    NO_NEW_BLOCKS,
    KVCacheManager,
    Request,
    RequestStatus,
    Scheduler,
    needs_sample,
)


def make(num_blocks=8, block_size=FrontEndArgs.block_size,
         budget=FrontEndArgs.max_num_batched_tokens, max_num_seqs=FrontEndArgs.max_num_seqs,
         max_model_len=512):  # the LLM's defaults, from their owner
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(KVCacheManager(pool), budget, max_num_seqs, max_model_len), pool


def request(name, prompt_len, max_tokens=8):
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def run_step(scheduler, token=0):
    out = scheduler.schedule()
    sampled = {r.request_id: token for r in out.scheduled_requests
               if needs_sample(r, out.num_scheduled_tokens[r.request_id])}
    return out, scheduler.update_from_output(out, sampled)


def test_chunked_prefill_takes_blocks_chunk_by_chunk():
    scheduler, pool = make(num_blocks=16, budget=20)
    scheduler.add_request(request("a", 70))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 20}
    assert pool.num_blocks - pool.get_num_free_blocks() == 2  # ceil(20 / 16), not ceil(70 / 16)
    chunks = [run_step(scheduler)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [20, 20, 10]
    assert scheduler.running[0].num_output_tokens == 1  # sampled only after the last chunk


def test_decodes_ride_with_a_prefill_chunk_under_the_budget():
    scheduler, _ = make(num_blocks=32, budget=16)
    scheduler.add_request(request("a", 4, max_tokens=20))
    run_step(scheduler)
    scheduler.add_request(request("b", 100))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}
    assert out.total_num_scheduled_tokens <= 16


def test_admission_needs_room_for_the_whole_prompt():
    scheduler, pool = make(num_blocks=4, budget=16)
    scheduler.add_request(request("big", 65))  # 5 blocks: never fits now
    scheduler.add_request(request("small", 10))
    out, _ = run_step(scheduler)
    assert out.scheduled_requests == [] and pool.get_num_free_blocks() == 4
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]  # first come, first served


def test_max_num_seqs_caps_the_running_set():
    scheduler, _ = make(num_blocks=64, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(request(name, 5))
    out, _ = run_step(scheduler)
    assert [r.request_id for r in out.scheduled_requests] == ["a", "b"]


def test_growth_calls_the_allocator_once_per_block():
    scheduler, pool = make(num_blocks=64, max_model_len=1024)
    scheduler.add_request(request("a", 9, max_tokens=300))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    # the last sampled token never has its K/V written: 9 + 300 - 1 positions in the cache
    assert pool.num_allocator_calls == -(-(9 + 300 - 1) // 16)


def test_preemption_takes_the_most_recent_and_admits_nobody_that_step():
    scheduler, pool = make(num_blocks=3, block_size=4, budget=64, max_model_len=64)
    for name in "abc":
        scheduler.add_request(request(name, 4, max_tokens=20))
    run_step(scheduler)  # one full block each, none free; each now has a 5th token to compute
    scheduler.add_request(request("d", 1))
    out, _ = run_step(scheduler)
    # a needs a second block: c (the most recent) leaves; then b needs one and leaves itself
    assert [r.request_id for r in out.preempted_requests] == ["c", "b"]
    assert [r.request_id for r in out.scheduled_requests] == ["a"]  # d is not admitted
    assert [r.request_id for r in scheduler.waiting] == ["b", "c", "d"]
    for victim in out.preempted_requests:
        assert victim.num_computed_tokens == 0 and victim.status is RequestStatus.PREEMPTED
        assert victim.num_tokens == 5  # its sampled token is kept, to be recomputed
        assert victim.request_id not in scheduler.kv_cache_manager.block_tables
    assert scheduler.num_preemptions == 2 and pool.get_num_free_blocks() == 1


def test_everything_finishes_and_the_pool_is_whole_again():
    scheduler, pool = make(num_blocks=10, budget=32, max_model_len=128)
    for i in range(12):
        scheduler.add_request(request(f"r{i}", 5 + 7 * i % 40, max_tokens=30))
    finished = []
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        finished += run_step(scheduler)[1]
    assert len(finished) == 12 and scheduler.num_preemptions > 0
    assert all(r.num_output_tokens == 30 for r in finished)
    assert pool.get_num_free_blocks() == pool.num_blocks


def test_stop_token_and_eos_finish_with_stop():
    scheduler, _ = make()
    r = Request("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    scheduler.add_request(r)
    run_step(scheduler, token=7)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.status.finish_reason == "stop"
    e = Request("b", [1, 2], SamplingParams(max_tokens=10), eos_token_id=3)
    scheduler.add_request(e)
    run_step(scheduler, token=3)
    assert e.status.finish_reason == "stop"
    ignoring = Request("c", [1], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=3)
    scheduler.add_request(ignoring)
    run_step(scheduler, token=3)
    run_step(scheduler, token=3)
    assert ignoring.status.finish_reason == "length" and ignoring.num_output_tokens == 2


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length_cap():
    # vLLM's check_stop looks at the token before the length: the answer ended by itself.
    scheduler, _ = make()
    r = Request("a", [1, 2], SamplingParams(max_tokens=1), eos_token_id=3)
    scheduler.add_request(r)
    run_step(scheduler, token=3)
    assert r.status.finish_reason == "stop"


def test_max_model_len_caps_the_answer():
    scheduler, _ = make(max_model_len=12)
    r = Request("a", list(range(10)), SamplingParams(max_tokens=None))
    scheduler.add_request(r)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert r.num_tokens == 12 and r.status.finish_reason == "length"


def test_abort_returns_the_blocks():
    scheduler, pool = make()
    r = request("a", 40)
    scheduler.add_request(r)
    run_step(scheduler)
    scheduler.abort_request(r)
    assert r.status.finish_reason == "abort" and pool.get_num_free_blocks() == pool.num_blocks
    assert not scheduler.has_unfinished_requests()


@pytest.mark.parametrize("num_tokens, free, ok", [(16, 1, True), (17, 1, False), (32, 2, True)])
def test_can_admit_counts_whole_blocks(num_tokens, free, ok):
    manager = KVCacheManager(BlockPool(free, 16))
    assert manager.can_admit(request("a", num_tokens)) is ok


# --- the KV cache manager's fast path: same answers, no waste, refusals at the boundary -----


class CountedTable(BlockTable):
    """A BlockTable that counts how many were built."""

    built = 0

    def __init__(self, pool):
        super().__init__(pool)
        CountedTable.built += 1


def test_allocate_slots_builds_a_table_only_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(scheduler_module, "BlockTable", CountedTable)
    monkeypatch.setattr(CountedTable, "built", 0)
    manager = KVCacheManager(BlockPool(num_blocks=8, block_size=4))
    r = request("a", 3)
    assert manager.allocate_slots(r, 3) is not None and CountedTable.built == 1
    table = manager.get_block_table(r)
    r.num_computed_tokens = 3
    for _ in range(6):  # decode steps: one needing nothing, then one crossing into block 2...
        assert manager.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert CountedTable.built == 1 and manager.get_block_table(r) is table
    assert table.block_ids == [0, 1, 2] and manager.pool.num_allocator_calls == 3
    assert manager.allocate_slots(r, 0) is NO_NEW_BLOCKS and CountedTable.built == 1  # none built


def test_allocate_slots_success_is_true_even_without_a_new_block():
    # vLLM's idiom `if not manager.allocate_slots(...)`: only the refusal, None, is false.
    manager = KVCacheManager(BlockPool(num_blocks=4, block_size=4))
    r = request("a", 3)
    assert manager.allocate_slots(r, 3)  # one new block
    r.num_computed_tokens = 3
    grown = manager.allocate_slots(r, 1)  # the last block has room: nothing new
    assert grown and len(grown) == 0 and grown is NO_NEW_BLOCKS
    assert manager.allocate_slots(request("b", 0), 0) is NO_NEW_BLOCKS  # no tokens, no block
    assert not manager.allocate_slots(request("c", 40), 40)  # refused: None, the one false
    assert manager.allocate_slots(request("d", 40), 40) is None


@pytest.mark.parametrize("num_new_tokens", [-1, 1.5, True, "3", None])
@pytest.mark.parametrize("running", [False, True])
def test_allocate_slots_refuses_a_count_that_is_not_one_before_changing_anything(
        num_new_tokens, running):
    manager = KVCacheManager(BlockPool(num_blocks=4, block_size=4))
    r = request("a", 6)
    if running:
        assert manager.allocate_slots(r, 4) is not None
        r.num_computed_tokens = 4
    before = (dict(manager.block_tables), manager.pool.get_num_free_blocks(),
              manager.pool.num_allocator_calls)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(r, num_new_tokens)
    assert (dict(manager.block_tables), manager.pool.get_num_free_blocks(),
            manager.pool.num_allocator_calls) == before


def test_allocate_slots_takes_numpy_counts_as_plain_ones():
    np = pytest.importorskip("numpy")
    manager = KVCacheManager(BlockPool(num_blocks=4, block_size=4))
    r = request("a", 6)
    assert manager.allocate_slots(r, np.int64(6)) is not None
    assert manager.get_block_table(r).block_ids == [0, 1]


@pytest.mark.parametrize("running", [False, True])
def test_a_short_pool_refuses_whole_on_both_paths(running):
    manager = KVCacheManager(BlockPool(num_blocks=3, block_size=4))
    other = request("other", 4)
    assert manager.allocate_slots(other, 4) is not None  # one block held by someone else
    r = request("a", 9)
    if running:
        assert manager.allocate_slots(r, 4) is not None
        r.num_computed_tokens = 4
    held = manager.block_tables.get("a") and manager.get_block_table(r).block_ids
    assert manager.allocate_slots(r, 9) is None  # would need 3 or 4 blocks in all
    assert (manager.block_tables.get("a") and manager.get_block_table(r).block_ids) == held
    assert ("a" in manager.block_tables) is running
    assert manager.pool.get_num_free_blocks() == (1 if running else 2)


def test_the_hot_path_agrees_with_the_counting_path():
    # every step's growth equals what get_num_blocks_to_allocate predicts for it
    manager = KVCacheManager(BlockPool(num_blocks=64, block_size=8))
    requests = [request(f"r{i}", 1) for i in range(5)]
    for step in range(1, 60):
        for i, r in enumerate(requests):
            num_new = 1 + (step * (i + 3)) % 11
            predicted = manager.get_num_blocks_to_allocate(r, r.num_computed_tokens + num_new)
            free = manager.pool.get_num_free_blocks()
            assert (manager.allocate_slots(r, num_new) is not None) is (predicted <= free)
            if predicted <= free:
                assert manager.pool.get_num_free_blocks() == free - predicted
                assert len(manager.get_block_table(r).blocks) == -(
                    -(r.num_computed_tokens + num_new) // 8)
                r.num_computed_tokens += num_new
            else:
                manager.free(r)
                r.num_computed_tokens = 0
    for r in requests:
        manager.free(r)
    assert manager.pool.get_num_free_blocks() == 64
