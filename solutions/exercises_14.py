"""Solutions to chapter 14's exercises that check themselves, and answers a checker must reject.

e5m2_code rounds an fp16's bit pattern to its top byte; blocks_in_pool counts a block's bytes
in each format. Each WRONG answer below is a mistake a reader could make;
tests/test_exercises.py runs them all."""


def e5m2_code(fp16_bits):
    return ((fp16_bits + 0x7F + ((fp16_bits >> 8) & 1)) >> 8) & 0xFF


def truncates(fp16_bits):
    """Drops the low byte: rounds toward zero."""
    return fp16_bits >> 8


def rounds_ties_up(fp16_bits):
    """Adds half a step: ties go away from zero instead of to even."""
    return ((fp16_bits + 0x80) >> 8) & 0xFF


def blocks_in_pool(pool_bytes, num_layers, num_kv_heads, head_dim, block_size, kv_cache_dtype):
    per_number = 2 if kv_cache_dtype == "auto" else 1
    scale = 4 if kv_cache_dtype == "int8_per_token_head" else 0
    block = 2 * num_layers * block_size * num_kv_heads * (head_dim * per_number + scale)
    return pool_bytes // block


def forgets_the_scales(pool_bytes, num_layers, num_kv_heads, head_dim, block_size,
                       kv_cache_dtype):
    """Counts int8 as one byte a number and nothing more."""
    per_number = 2 if kv_cache_dtype == "auto" else 1
    return pool_bytes // (2 * num_layers * block_size * num_kv_heads * head_dim * per_number)


def one_scale_per_token(pool_bytes, num_layers, num_kv_heads, head_dim, block_size,
                        kv_cache_dtype):
    """One scale per token, shared by its heads, instead of one per token and head."""
    per_number = 2 if kv_cache_dtype == "auto" else 1
    scale = 4 if kv_cache_dtype == "int8_per_token_head" else 0
    return pool_bytes // (2 * num_layers * block_size * (num_kv_heads * head_dim * per_number
                                                         + scale))


SOLUTIONS = {
    "check_e5m2_code": (e5m2_code, [truncates, rounds_ties_up]),
    "check_blocks_in_pool": (blocks_in_pool, [forgets_the_scales, one_scale_per_token]),
}
