"""Solutions to chapter 5's exercises that check themselves, and answers a checker must reject."""
import torch


def key_offset(block_table, position, block_size, block_stride, slot_stride):
    return block_table[position // block_size] * block_stride + position % block_size * slot_stride


def contiguous(block_table, position, block_size, block_stride, slot_stride):
    """Forgets the table: the address of a contiguous cache."""
    return position * slot_stride


def swapped(block_table, position, block_size, block_stride, slot_stride):
    """Swaps the quotient and the remainder."""
    return block_table[position % block_size] * block_stride + position // block_size * slot_stride


def online_softmax_step(running_max, running_sum, acc, scores, values):
    new_max = torch.maximum(running_max, scores.max())
    weights = torch.exp(scores - new_max)
    rescale = torch.exp(running_max - new_max)  # how far the maximum moved
    return new_max, running_sum * rescale + weights.sum(), acc * rescale + weights @ values


def accumulator_not_rescaled(running_max, running_sum, acc, scores, values):
    """Rescales the sum but forgets the accumulator."""
    new_max = torch.maximum(running_max, scores.max())
    weights = torch.exp(scores - new_max)
    rescale = torch.exp(running_max - new_max)
    return new_max, running_sum * rescale + weights.sum(), acc + weights @ values


def rescale_upside_down(running_max, running_sum, acc, scores, values):
    """Multiplies by exp(new max - old max), the inverse of the right factor."""
    new_max = torch.maximum(running_max, scores.max())
    weights = torch.exp(scores - new_max)
    rescale = torch.exp(new_max - running_max)
    return new_max, running_sum * rescale + weights.sum(), acc * rescale + weights @ values


def tile_max_only(running_max, running_sum, acc, scores, values):
    """Takes the tile's maximum as the running one, forgetting the positions before it."""
    new_max = scores.max()
    weights = torch.exp(scores - new_max)
    rescale = torch.exp(running_max - new_max)
    return new_max, running_sum * rescale + weights.sum(), acc * rescale + weights @ values


SOLUTIONS = {
    "check_key_offset": (key_offset, [contiguous, swapped]),
    "check_online_softmax_step": (online_softmax_step,
                                  [accumulator_not_rescaled, rescale_upside_down, tile_max_only]),
}
