"""Solutions to chapter 12's exercises that check themselves, and answers a checker must reject.

sequences_held counts what two caches of the same bytes hold; llm_classes is the rule by which
the package's EngineArgs picks each chapter's class. Each WRONG answer below is a mistake a
reader could make; tests/test_exercises.py runs them all."""


def sequences_held(lengths, num_blocks, block_size, max_model_len):
    reserved = min(len(lengths), num_blocks * block_size // max_model_len)
    paged, free = 0, num_blocks
    for length in lengths:
        need = -(-length // block_size)  # ceil: a partly filled last block is a whole block
        if need > free:
            break
        paged, free = paged + 1, free - need
    return reserved, paged


def floors_the_blocks(lengths, num_blocks, block_size, max_model_len):
    """Floors instead of ceiling: the unfinished last block costs nothing."""
    reserved = min(len(lengths), num_blocks * block_size // max_model_len)
    paged, free = 0, num_blocks
    for length in lengths:
        need = max(length // block_size, 1)
        if need > free:
            break
        paged, free = paged + 1, free - need
    return reserved, paged


def counts_tokens_not_blocks(lengths, num_blocks, block_size, max_model_len):
    """Pages by the token: forgets that a sequence holds whole blocks."""
    reserved = min(len(lengths), num_blocks * block_size // max_model_len)
    paged, free = 0, num_blocks * block_size
    for length in lengths:
        if length > free:
            break
        paged, free = paged + 1, free - length
    return reserved, paged


def reservations_uncapped(lengths, num_blocks, block_size, max_model_len):
    """Counts the reservations the cache has room for, not the sequences that take them."""
    return num_blocks * block_size // max_model_len, sequences_held(
        lengths, num_blocks, block_size, max_model_len)[1]


MANAGERS = {  # (prefix caching, parallel_sampling, hits inside a block) -> manager
    (False, "split", False): "KVCacheManager",
    (True, "split", False): "PrefixCachingKVCacheManager",
    (True, "split", True): "SubBlockPrefixCachingKVCacheManager",
    (False, "fork", False): "CopyOnWriteKVCacheManager",
    (True, "fork", False): "CopyOnWritePrefixCachingKVCacheManager",
    (True, "fork", True): "CopyOnWriteSubBlockPrefixCachingKVCacheManager",
}
ENGINES = {  # (preemption_mode, what the manager asks of the engine) -> engine
    ("recompute", None): "LLMEngine", ("recompute", "copies"): "CopyingEngine",
    ("recompute", "fork"): "ForkingEngine", ("swap", None): "SwappingEngine",
    ("swap", "copies"): "SwappingCopyingEngine", ("swap", "fork"): "SwappingForkingEngine",
}
SCHEDULERS = {"recompute": "Scheduler", "swap": "SwapScheduler"}


def llm_classes(enable_prefix_caching, parallel_sampling, prefix_match_unit, preemption_mode,
                block_size):
    inside = prefix_match_unit is not None and prefix_match_unit < block_size
    needs = "fork" if parallel_sampling == "fork" else "copies" if inside else None
    return (MANAGERS[enable_prefix_caching, parallel_sampling, inside],
            ENGINES[preemption_mode, needs], SCHEDULERS[preemption_mode])


def any_unit_is_inside(enable_prefix_caching, parallel_sampling, prefix_match_unit,
                       preemption_mode, block_size):
    """Takes any prefix_match_unit for hits inside a block, even one the size of the block."""
    inside = prefix_match_unit is not None
    needs = "fork" if parallel_sampling == "fork" else "copies" if inside else None
    return (MANAGERS[enable_prefix_caching, parallel_sampling, inside],
            ENGINES[preemption_mode, needs], SCHEDULERS[preemption_mode])


def copies_before_forks(enable_prefix_caching, parallel_sampling, prefix_match_unit,
                        preemption_mode, block_size):
    """Lets a sub-block manager's copies win over forks when choosing the engine."""
    inside = prefix_match_unit is not None and prefix_match_unit < block_size
    needs = "copies" if inside else "fork" if parallel_sampling == "fork" else None
    return (MANAGERS[enable_prefix_caching, parallel_sampling, inside],
            ENGINES[preemption_mode, needs], SCHEDULERS[preemption_mode])


def swap_is_one_engine(enable_prefix_caching, parallel_sampling, prefix_match_unit,
                       preemption_mode, block_size):
    """Forgets the two composed engines: swapping always picks chapter 11's engine."""
    manager, engine, scheduler = llm_classes(enable_prefix_caching, parallel_sampling,
                                             prefix_match_unit, preemption_mode, block_size)
    return manager, "SwappingEngine" if preemption_mode == "swap" else engine, scheduler


SOLUTIONS = {
    "check_sequences_held": (sequences_held, [floors_the_blocks, counts_tokens_not_blocks,
                                              reservations_uncapped]),
    "check_llm_classes": (llm_classes, [any_unit_is_inside, copies_before_forks,
                                        swap_is_one_engine]),
}
