"""Solutions to chapter 4's exercises that check themselves, and answers a checker must reject."""
import torch


def gather_keys(kv_cache_layer: torch.Tensor, block_ids: list[int], length: int,
                num_kv_heads: int) -> torch.Tensor:
    head_dim = kv_cache_layer.shape[-1] // num_kv_heads
    block_size = kv_cache_layer.shape[2]
    needed = block_ids[: -(-length // block_size)]  # a padded table: only the blocks reached
    return kv_cache_layer[needed, 0].reshape(-1, num_kv_heads, head_dim)[:length]


def whole_blocks(kv_cache_layer: torch.Tensor, block_ids: list[int], length: int,
                 num_kv_heads: int) -> torch.Tensor:
    """Forgets to cut the last block's tail at the length."""
    head_dim = kv_cache_layer.shape[-1] // num_kv_heads
    block_size = kv_cache_layer.shape[2]
    needed = block_ids[: -(-length // block_size)]
    return kv_cache_layer[needed, 0].reshape(-1, num_kv_heads, head_dim)


def reads_values(kv_cache_layer: torch.Tensor, block_ids: list[int], length: int,
                 num_kv_heads: int) -> torch.Tensor:
    """Takes index 1 of the second axis: the values, not the keys."""
    head_dim = kv_cache_layer.shape[-1] // num_kv_heads
    block_size = kv_cache_layer.shape[2]
    needed = block_ids[: -(-length // block_size)]
    return kv_cache_layer[needed, 1].reshape(-1, num_kv_heads, head_dim)[:length]


def sorted_blocks(kv_cache_layer: torch.Tensor, block_ids: list[int], length: int,
                  num_kv_heads: int) -> torch.Tensor:
    """Reads the blocks in pool order instead of table order."""
    head_dim = kv_cache_layer.shape[-1] // num_kv_heads
    block_size = kv_cache_layer.shape[2]
    needed = sorted(block_ids[: -(-length // block_size)])
    return kv_cache_layer[needed, 0].reshape(-1, num_kv_heads, head_dim)[:length]


SOLUTIONS = {"check_gather_keys": (gather_keys, [whole_blocks, reads_values, sorted_blocks])}
