"""Solutions to chapter 7's exercises that check themselves, and answers a checker must reject.

Exercise 1 counts the free blocks an allocation uses up (KVCacheManager.get_num_blocks_to_allocate);
exercise 4 preempts the running request that holds the most blocks (a Scheduler subclass)."""
from minipaged.checks import cdiv
from minipaged.scheduler import RequestStatus, Scheduler


def blocks_to_allocate(num_tokens: int, block_size: int, num_held: int,
                       hit_ref_cnts: list[int]) -> int:
    new = max(0, cdiv(num_tokens, block_size) - num_held - len(hit_ref_cnts))
    return new + sum(1 for count in hit_ref_cnts if count == 0)


def floors(num_tokens: int, block_size: int, num_held: int, hit_ref_cnts: list[int]) -> int:
    """Floors instead of rounding up: a part-filled last block is forgotten."""
    new = max(0, num_tokens // block_size - num_held - len(hit_ref_cnts))
    return new + sum(1 for count in hit_ref_cnts if count == 0)


def hits_are_free(num_tokens: int, block_size: int, num_held: int,
                  hit_ref_cnts: list[int]) -> int:
    """Forgets that a found block with ref_cnt 0 sits in the free queue."""
    return max(0, cdiv(num_tokens, block_size) - num_held - len(hit_ref_cnts))


def no_clamp(num_tokens: int, block_size: int, num_held: int, hit_ref_cnts: list[int]) -> int:
    """Forgets that a request already holding enough blocks needs none, not fewer than none."""
    new = cdiv(num_tokens, block_size) - num_held - len(hit_ref_cnts)
    return new + sum(1 for count in hit_ref_cnts if count == 0)


def held_blocks(scheduler: Scheduler, request) -> int:
    table = scheduler.kv_cache_manager.block_tables.get(request.request_id)
    return len(table.blocks) if table else 0


class LargestFirst(Scheduler):
    """Preempts the running request holding the most blocks, among those not yet served this
    step (one already in the batch keeps its place)."""

    def schedule_running(self, out, token_budget: int) -> int:
        manager, index = self.kv_cache_manager, 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while manager.allocate_slots(request, num_new) is None:
                victim = max(self.running[index:], key=lambda r: held_blocks(self, r))
                self.running.remove(victim)
                self.preempt(victim, out)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                continue  # it left the running list: the next request now stands at index
            out.scheduled_requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            index += 1
        return token_budget


class LargestOfAll(LargestFirst):
    """Picks the largest among all running requests, even one already in this step's batch:
    its blocks go back while the batch still points at them."""

    def schedule_running(self, out, token_budget: int) -> int:
        manager, index = self.kv_cache_manager, 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while manager.allocate_slots(request, num_new) is None:
                victim = max(self.running, key=lambda r: held_blocks(self, r))
                self.running.remove(victim)
                self.preempt(victim, out)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            out.scheduled_requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            index += 1
        return token_budget


class KeepsBlocks(Scheduler):
    """Preempts without giving the blocks back: the pool only ever shrinks."""

    def preempt(self, request, out) -> None:
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_requests.append(request)


class PreemptsOldest(Scheduler):
    """Preempts the request admitted first, even when it is already in this step's batch."""

    def schedule_running(self, out, token_budget: int) -> int:
        manager, index = self.kv_cache_manager, 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while manager.allocate_slots(request, num_new) is None:
                victim = self.running.pop(0)
                self.preempt(victim, out)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            out.scheduled_requests.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            index += 1
        return token_budget


SOLUTIONS = {
    "check_num_blocks_to_allocate": (blocks_to_allocate, [floors, hits_are_free, no_clamp]),
    "check_scheduler": (LargestFirst, [LargestOfAll, KeepsBlocks, PreemptsOldest]),
    "check_largest_first": (LargestFirst, [Scheduler, LargestOfAll, KeepsBlocks]),
}
