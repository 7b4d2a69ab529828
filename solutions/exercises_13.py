"""Solutions to chapter 13's exercise that checks itself, and answers its checker must reject.

pow2_blocks is the reservation Orca (Pow2) makes, as the PagedAttention paper defines it: the
prompt plus the next power of two of the output, capped at the context limit, in whole blocks.
Each WRONG answer below is a mistake a reader could make; tests/test_exercises.py runs them all."""


def pow2_blocks(prompt_len, output_len, block_size, max_model_len):
    tokens = min(prompt_len + (1 << (output_len - 1).bit_length()), max_model_len)
    return -(-tokens // block_size)


def rounds_the_whole_length(prompt_len, output_len, block_size, max_model_len):
    """Rounds prompt plus output up to a power of two: over-reserves the prompt too."""
    tokens = min(1 << (prompt_len + output_len - 1).bit_length(), max_model_len)
    return -(-tokens // block_size)


def doubles_a_power_of_two(prompt_len, output_len, block_size, max_model_len):
    """Takes the power of two above the output, even when the output is one already."""
    tokens = min(prompt_len + (1 << output_len.bit_length()), max_model_len)
    return -(-tokens // block_size)


def forgets_the_cap(prompt_len, output_len, block_size, max_model_len):
    """Rounds up past the context limit, which no request can reach."""
    tokens = prompt_len + (1 << (output_len - 1).bit_length())
    return -(-tokens // block_size)


SOLUTIONS = {"check_pow2_blocks": (pow2_blocks, [rounds_the_whole_length, doubles_a_power_of_two,
                                                 forgets_the_cap])}
