"""Solutions to chapter 9's exercises that check themselves, and answers a checker must reject."""
from minipaged.prefix_cache import hash_block_tokens


def salted_block_hashes(token_ids: list[int], block_size: int,
                        cache_salt: str | None) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = (("cache_salt", cache_salt),) if start == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys)
        hashes.append(parent)
    return hashes


def salts_every_block(token_ids: list[int], block_size: int,
                      cache_salt: str | None) -> list[bytes]:
    """Puts the salt in every block's extra keys, though the chain already carries it."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = (("cache_salt", cache_salt),) if cache_salt is not None else ()
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys)
        hashes.append(parent)
    return hashes


def forgets_the_salt(token_ids: list[int], block_size: int,
                     cache_salt: str | None) -> list[bytes]:
    """Chapter 8's plain chain: every tenant shares everything."""
    return salted_block_hashes(token_ids, block_size, None)


def bare_salt(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """Puts the bare string in the extra keys, as vLLM does, not chapter 8's tagged pair."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = (cache_salt,) if start == 0 and cache_salt is not None else ()
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys)
        hashes.append(parent)
    return hashes


def salt_block(prompt_token_ids: list[int], public_prefix: list[int], block_size: int) -> int:
    if list(prompt_token_ids[:len(public_prefix)]) != list(public_prefix):
        return 0
    return len(public_prefix) // block_size


def rounds_up(prompt_token_ids: list[int], public_prefix: list[int], block_size: int) -> int:
    """Counts the block where the public prefix ends as public: private tokens go unsalted."""
    if list(prompt_token_ids[:len(public_prefix)]) != list(public_prefix):
        return 0
    return -(-len(public_prefix) // block_size)


def trusts_the_prompt(prompt_token_ids: list[int], public_prefix: list[int],
                      block_size: int) -> int:
    """Never checks that the prompt begins with the public prefix."""
    return len(public_prefix) // block_size


SOLUTIONS = {
    "check_salted_block_hashes": (salted_block_hashes,
                                  [salts_every_block, forgets_the_salt, bare_salt]),
    "check_salt_block": (salt_block, [rounds_up, trusts_the_prompt]),
}
