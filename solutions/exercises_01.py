"""Solutions to chapter 1's exercises that check themselves, and answers a checker must reject.

Each solution module names, for every checker of its chapter, the solution and a few wrong
answers (WRONG), each a mistake a reader could make; tests/test_exercises.py runs them all."""


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def keys_only(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Forgets the values: half the answer."""
    return num_layers * num_kv_heads * head_dim * dtype_bytes


def one_layer(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Prices a single layer."""
    return 2 * num_kv_heads * head_dim * dtype_bytes


SOLUTIONS = {"check_kv_bytes_per_token": (kv_bytes_per_token, [keys_only, one_layer])}
