"""Solutions to chapter 2's exercises that check themselves, and answers a checker must reject."""


def empty_tail_slots(lengths: list[int], block_size: int) -> int:
    return sum(-(-length // block_size) * block_size - length for length in lengths)


def counts_a_full_last_block(lengths: list[int], block_size: int) -> int:
    """Takes B - L % B for every length: a last block filled exactly counts as B empty slots."""
    return sum(block_size - length % block_size for length in lengths)


def counts_the_written_part(lengths: list[int], block_size: int) -> int:
    """Floors instead of ceiling: L % B is the written part of the last block, not the empty one."""
    return sum(length % block_size for length in lengths)


SOLUTIONS = {"check_empty_tail_slots": (empty_tail_slots,
                                        [counts_a_full_last_block, counts_the_written_part])}
