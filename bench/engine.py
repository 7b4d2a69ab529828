"""minipaged against transformers' generate on one mixed-length batch: speed and cache held.

The same random Qwen2-geometry model (chapter 6's small preset, 2 layers; ``--layers`` to
change) answers the same batch of prompts with lengths drawn from chapter 2's long-tailed mix
(median 180, capped), greedy, a fixed number of new tokens each:

* transformers' ``generate`` on the whole batch at once, left-padded to the longest prompt,
  its cache a DynamicCache that grows to batch x (longest prompt + new tokens) positions;
* minipaged's ``LLM.generate``, prompts unpadded, blocks of 16 taken as each sequence grows.

It reports output tokens per second for each and their ratio, and the bytes of KV cache each
holds at its peak (transformers: the tensors of its cache after the last step; minipaged: the
blocks in use at the busiest step). It also checks that the two agree on the greedy tokens of
every prompt. Timings are reported, never asserted. The CSV goes to bench/results/engine.csv.

    python bench/engine.py            # 32 prompts, 64 new tokens
    python bench/engine.py --quick    # 8 prompts, 16 new tokens, to check the script runs
"""
from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import numpy as np
import torch

from minipaged import LLM, SamplingParams
from minipaged.huggingface import to_transformers
from minipaged.model import ModelConfig, random_model

RESULTS = Path(__file__).resolve().parent / "results"


def prompt_lengths(num: int, cap: int, seed: int = 0) -> list[int]:
    """Lognormal lengths with chapter 2's median (180) and mean (260), clipped to [1, cap]."""
    sigma = np.sqrt(2 * np.log(260 / 180))
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(180), sigma, num).round(), 1, cap).astype(int).tolist()


def cache_bytes(past_key_values) -> int:
    """Bytes held by the tensors of a transformers cache."""
    total = 0
    for layer in getattr(past_key_values, "layers", []):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_prompts, new_tokens = (8, 16) if args.quick else (32, 64)
    config = ModelConfig.small(num_layers=args.layers)
    model = random_model(config, seed=0)
    peer = to_transformers(model)
    lengths = prompt_lengths(num_prompts, cap=config.max_position_embeddings // 2 - new_tokens)
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, config.vocab_size, (n,), generator=rng).tolist() for n in lengths]

    longest = max(lengths)
    ids = torch.zeros(num_prompts, longest, dtype=torch.long)
    mask = torch.zeros(num_prompts, longest, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as batched generation needs
        ids[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    start = time.perf_counter()
    hf = peer.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0, return_dict_in_generate=True)
    hf_seconds = time.perf_counter() - start
    hf_tokens = hf.sequences[:, longest:].tolist()
    cache = getattr(hf, "cache", None)
    hf_cache = cache_bytes(cache if cache is not None else hf.past_key_values)

    llm = LLM(model=model, max_model_len=config.max_position_embeddings,
              enable_prefix_caching=False)  # the engine without chapter 8's cache
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ours_seconds = time.perf_counter() - start
    stats = llm.llm_engine.stats()
    per_token = config.model_shape(4).kv_bytes_per_token
    ours_cache = stats["peak_num_used_blocks"] * llm.llm_engine.pool.block_size * per_token
    agree = sum(o.outputs[0].token_ids == t for o, t in zip(outputs, hf_tokens))

    total = num_prompts * new_tokens
    rows = [dict(engine="transformers generate (padded)", prompts=num_prompts,
                 new_tokens=new_tokens, seconds=round(hf_seconds, 3),
                 output_tokens_per_s=round(total / hf_seconds, 1), peak_cache_bytes=hf_cache),
            dict(engine="minipaged LLM.generate", prompts=num_prompts, new_tokens=new_tokens,
                 seconds=round(ours_seconds, 3), output_tokens_per_s=round(total / ours_seconds, 1),
                 peak_cache_bytes=ours_cache)]
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "engine.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{num_prompts} prompts of {min(lengths)}..{longest} tokens (mean "
          f"{np.mean(lengths):.0f}), {new_tokens} new tokens each, {args.threads} thread(s)")
    for row in rows:
        print(f"{row['engine']:32} {row['output_tokens_per_s']:9,.1f} tok/s  "
              f"peak cache {row['peak_cache_bytes'] / 2**20:8.2f} MiB")
    print(f"minipaged / transformers: speed {hf_seconds / ours_seconds:.2f}x, "
          f"cache {ours_cache / hf_cache:.2f}x; greedy answers agree on {agree}/{num_prompts} "
          f"prompts (padding changes transformers' arithmetic slightly)")


if __name__ == "__main__":
    main()
