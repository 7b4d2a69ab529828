"""Solutions to chapter 8's exercises that check themselves, and answers a checker must reject."""
from minipaged.prefix_cache import hash_block_tokens


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def unchained(token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes each block on its own, with no parent: equal blocks anywhere get equal names."""
    return [hash_block_tokens(None, token_ids[start:start + block_size])
            for start in range(0, len(token_ids) - block_size + 1, block_size)]


def hashes_the_tail(token_ids: list[int], block_size: int) -> list[bytes]:
    """Counts blocks with a ceiling: the partial last block gets a hash too."""
    hashes, parent = [], None
    for start in range(0, len(token_ids), block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def prefix_hit_tokens(token_ids: list[int], earlier_prompts: list[list[int]],
                      block_size: int) -> int:
    cached = {h for prompt in earlier_prompts for h in block_hashes(prompt, block_size)}
    found = 0
    for block_hash in block_hashes(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        if block_hash not in cached:
            break
        found += block_size
    return found


def all_of_it(token_ids: list[int], earlier_prompts: list[list[int]], block_size: int) -> int:
    """Forgets the last token must still be computed: a fully cached prompt is found whole."""
    cached = {h for prompt in earlier_prompts for h in block_hashes(prompt, block_size)}
    found = 0
    for block_hash in block_hashes(token_ids, block_size):
        if block_hash not in cached:
            break
        found += block_size
    return found


def blocks_by_position(token_ids: list[int], earlier_prompts: list[list[int]],
                       block_size: int) -> int:
    """Compares each block's tokens with an earlier prompt's block at the same place, ignoring
    what came before it, and does not stop at a miss."""
    def block(tokens, index):
        return tuple(tokens[index * block_size:(index + 1) * block_size])

    found = 0
    for index in range((len(token_ids) - 1) // block_size):
        if any(len(p) >= (index + 1) * block_size and block(p, index) == block(token_ids, index)
               for p in earlier_prompts):
            found += block_size
    return found


SOLUTIONS = {
    "check_block_hashes": (block_hashes, [unchained, hashes_the_tail]),
    "check_prefix_hit_tokens": (prefix_hit_tokens, [all_of_it, blocks_by_position]),
}
