"""Solutions to chapter 10's exercises that check themselves, and answers a checker must reject."""


def block_to_copy(ref_counts: list[int], block_size: int, position: int) -> int | None:
    index = position // block_size
    if index < len(ref_counts) and ref_counts[index] > 1:
        return index
    return None


def last_block(ref_counts: list[int], block_size: int, position: int) -> int | None:
    """Looks at the table's last block, wherever the token goes (a full prompt's write goes into
    a fresh block)."""
    return len(ref_counts) - 1 if ref_counts[-1] > 1 else None


def counts_itself(ref_counts: list[int], block_size: int, position: int) -> int | None:
    """Copies a block that only this table holds: a count of at least 1 instead of above 1."""
    index = position // block_size
    return index if index < len(ref_counts) and ref_counts[index] >= 1 else None


def any_shared(ref_counts: list[int], block_size: int, position: int) -> int | None:
    """Copies the written block whenever any block of the table is shared (the last writer of a
    partial block holds it alone, even while the full blocks stay shared)."""
    index = position // block_size
    return index if index < len(ref_counts) and max(ref_counts) > 1 else None


SOLUTIONS = {"check_block_to_copy": (block_to_copy, [last_block, counts_itself, any_shared])}
