"""Solutions to chapter 3's exercises that check themselves, and answers a checker must reject."""
import math


def slot(block_ids: list[int], position: int, block_size: int) -> int:
    return block_ids[position // block_size] * block_size + position % block_size


def swaps_entry_and_offset(block_ids: list[int], position: int, block_size: int) -> int:
    """Takes the table entry from position % B and the offset from position // B."""
    return block_ids[(position % block_size) % len(block_ids)] * block_size + position // block_size


def forgets_the_block_size(block_ids: list[int], position: int, block_size: int) -> int:
    """Adds the offset to the block's number, as if every block held one token."""
    return block_ids[position // block_size] + position % block_size


def ignores_the_table(block_ids: list[int], position: int, block_size: int) -> int:
    """Treats the sequence as contiguous from slot 0: right only for a table [0, 1, 2, ...]."""
    return position


def float_offset(block_ids: list[int], position: int, block_size: int) -> float:
    """Takes the offset with math.fmod, a float: the right number, but no index into a tensor."""
    return block_ids[position // block_size] * block_size + math.fmod(position, block_size)


SOLUTIONS = {"check_slot": (slot, [swaps_entry_and_offset, forgets_the_block_size,
                                   ignores_the_table, float_offset])}
