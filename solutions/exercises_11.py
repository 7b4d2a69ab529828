"""Solutions to chapter 11's exercises that check themselves, and answers a checker must reject."""
import math


def break_even_link(num_tokens: int, block_size: int, bytes_per_block: int,
                    recompute_s: float) -> float:
    return 2 * math.ceil(num_tokens / block_size) * bytes_per_block / recompute_s


def one_way(num_tokens: int, block_size: int, bytes_per_block: int, recompute_s: float) -> float:
    """Prices the swap-out alone, forgetting that the blocks come back in."""
    return math.ceil(num_tokens / block_size) * bytes_per_block / recompute_s


def floors(num_tokens: int, block_size: int, bytes_per_block: int, recompute_s: float) -> float:
    """Floors the block count: a partly filled last block is left behind."""
    return 2 * (num_tokens // block_size) * bytes_per_block / recompute_s


def by_token(num_tokens: int, block_size: int, bytes_per_block: int, recompute_s: float) -> float:
    """Moves the tokens' bytes, not whole blocks."""
    return 2 * num_tokens * (bytes_per_block / block_size) / recompute_s


SOLUTIONS = {"check_break_even_link": (break_even_link, [one_way, floors, by_token])}
