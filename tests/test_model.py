"""The Qwen2 model on the paged cache, checked against transformers' Qwen2ForCausalLM."""
from __future__ import annotations

import inspect
import json
import weakref
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minipaged.kernels
import minipaged.model
from minipaged.huggingface import load_model, save_pretrained, to_transformers
from minipaged.kernels import paged_attention
from minipaged.kv_cache import KVCache, reference_paged_attention
from minipaged.model import (
    AttentionMetadata,
    ModelConfig,
    Qwen2ForCausalLM,
    prepare_metadata,
    random_model,
)

transformers = pytest.importorskip("transformers")

# Qwen/Qwen2.5-0.5B-Instruct's config.json, every key of it.
QWEN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
BLOCK_SIZE = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ModelConfig.small(num_layers=2, vocab_size=256)


@pytest.fixture(scope="module")
def model(config) -> Qwen2ForCausalLM:
    return random_model(config, seed=3, attention_backend="torch")


@pytest.fixture(scope="module")
def peer(model):
    return to_transformers(model)


def reference_logits(peer, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return peer(torch.tensor([prompt])).logits[0].float()


def make_prompts(lengths, vocab_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def scattered_tables(lengths, extra_blocks=5, seed=0):
    """Block tables over a shuffled pool: no sequence's blocks adjacent or in order."""
    needed = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(needed) + extra_blocks
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, taken = [], 0
    for n in needed:
        tables.append(order[taken: taken + n])
        taken += n
    return tables, num_blocks


def new_cache(config, num_blocks):
    return KVCache(config.num_hidden_layers, num_blocks, BLOCK_SIZE, config.num_key_value_heads,
                   config.head_dim)


def run_schedule(model, prompts, tables, num_blocks, chunks):
    """Feed each prompt in the given chunk sizes, all sequences together; logits per position."""
    cache = new_cache(model.config, num_blocks)
    computed = [0] * len(prompts)
    outputs = [[] for _ in prompts]
    for step in range(max(len(c) for c in chunks)):
        alive = [s for s in range(len(prompts)) if step < len(chunks[s])]
        sizes = [chunks[s][step] for s in alive]
        metadata = prepare_metadata([tables[s] for s in alive], [computed[s] for s in alive],
                                    sizes, BLOCK_SIZE, logits_at_every_token=True)
        ids = [t for s, n in zip(alive, sizes) for t in prompts[s][computed[s]: computed[s] + n]]
        logits = model(torch.tensor(ids), metadata, cache)
        for s, rows in zip(alive, logits.split(sizes)):
            outputs[s].append(rows)
            computed[s] += rows.shape[0]
    return [torch.cat(rows) for rows in outputs]


# --- configuration -------------------------------------------------------------------------

def test_config_from_the_real_checkpoint():
    config = ModelConfig.from_hf_config(QWEN_CONFIG)
    assert config.head_dim == 64 and config.num_key_value_heads == 2
    assert config.model_shape(2).kv_bytes_per_token == 12_288
    assert config.eos_token_id == 151645


def test_config_reads_rope_parameters_and_eos_lists():
    hf = dict(QWEN_CONFIG, eos_token_id=[7, 8])
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_theta": 5000.0, "rope_type": "default"}
    config = ModelConfig.from_hf_config(hf)
    assert config.rope_theta == 5000.0 and config.eos_token_id == 7


def test_config_round_trips_through_hf_dict(config):
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


@pytest.mark.parametrize("change, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_config_refuses_what_it_cannot_run(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(QWEN_CONFIG | change)


@pytest.mark.parametrize("change, field", [
    ({"rope_theta": 0}, "rope_theta"),  # once swallowed by `or` and read as 10000.0
    ({"rope_theta": 0, "rope_parameters": {"rope_theta": 5000.0}}, "rope_theta"),
    ({"head_dim": 0}, "head_dim"),  # once swallowed by `or` and read as 64
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"eos_token_id": []}, "eos_token_id"),  # once an IndexError
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"eos_token_id": QWEN_CONFIG["vocab_size"]}, "eos_token_id"),  # once accepted
])
def test_config_refuses_present_zeros_and_empty_lists(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(QWEN_CONFIG | change)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads",
                                   "max_position_embeddings"])
def test_config_names_a_missing_required_field(field):
    """A missing field is a ValueError naming it, not a KeyError."""
    hf = dict(QWEN_CONFIG)
    del hf[field]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(hf)


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_config_reads_nulls_as_absent():
    """transformers writes head_dim and rope_theta as null when unset: the defaults apply."""
    hf = QWEN_CONFIG | {"head_dim": None, "rope_theta": None,
                        "rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}
    config = ModelConfig.from_hf_config(hf)
    assert config.head_dim == 64 and config.rope_theta == 5000.0
    assert ModelConfig.from_hf_config(QWEN_CONFIG | {"rope_theta": None}).rope_theta == 10_000.0


def test_small_keeps_the_real_head_geometry():
    config = ModelConfig.small()
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (14, 2, 64)


@pytest.mark.heavy  # seconds: builds the full-size model on the meta device
def test_real_parameter_count():
    with torch.device("meta"):
        model = Qwen2ForCausalLM(ModelConfig.from_hf_config(QWEN_CONFIG))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768


# --- metadata ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_transformers(config, dtype):
    """apply_rotary_ turns the buffer it is given, equal to transformers' Qwen2 rotary."""
    from transformers.models.qwen2 import modeling_qwen2 as hf

    positions = torch.tensor([0, 1, 5, 300, 2047, 7])
    hf_rotary = hf.Qwen2RotaryEmbedding(transformers.Qwen2Config(**config.to_hf_config()))
    generator = torch.Generator().manual_seed(0)
    heads = config.num_attention_heads + config.num_key_value_heads
    qkv = torch.randn(len(positions), (heads + 3) * config.head_dim, generator=generator)
    x = qkv[:, : heads * config.head_dim].view(len(positions), heads, config.head_dim).to(dtype)
    before = x.clone()
    cos, sin = hf_rotary(before, positions[None])  # [1, T, head_dim], in x's dtype
    want_q, want_k = hf.apply_rotary_pos_emb(before[None, :, :2].transpose(1, 2),
                                             before[None, :, 2:].transpose(1, 2), cos, sin)
    want = torch.cat([want_q, want_k], 1).transpose(1, 2)[0]
    ours = minipaged.model.RotaryEmbedding(config.head_dim, config.rope_theta)(positions)
    assert ours[0].shape == (len(positions), config.head_dim // 2)
    copied = minipaged.model.apply_rotary(x, *ours)
    assert torch.equal(x, before)  # the copying version leaves its input alone
    turned = minipaged.model.apply_rotary_(x, *ours)
    assert turned is x  # in place
    tolerance = dict(rtol=0, atol=5e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(turned.float(), want.float(), **tolerance)
    torch.testing.assert_close(copied, turned)


def test_prepare_metadata_by_hand():
    metadata = prepare_metadata([[3, 9], [4, 7]], [6, 0], [1, 5], block_size=4)
    assert metadata.positions.tolist() == [6, 0, 1, 2, 3, 4]
    assert metadata.slot_mapping.tolist() == [38, 16, 17, 18, 19, 28]
    assert metadata.seq_lens.tolist() == [7, 5]
    assert metadata.query_start_loc.tolist() == [0, 1, 6]
    assert metadata.logits_indices.tolist() == [0, 5]
    assert (metadata.num_tokens, metadata.num_seqs) == (6, 2)


def test_prepare_metadata_pads_block_tables():
    metadata = prepare_metadata([[5], [1, 2, 3]], [0, 0], [2, 9], block_size=4,
                                logits_at_every_token=True)
    assert metadata.block_tables.shape == (2, 3)
    assert metadata.block_tables.dtype == torch.int32  # as vLLM keeps them
    assert metadata.block_tables.tolist() == [[5, -1, -1], [1, 2, 3]]  # -1: padding, never read
    assert metadata.logits_indices is None


@pytest.mark.parametrize("tables, computed, scheduled, field", [
    ([], [], [], "block_tables"),
    ([[1]], [4], [1], "block_tables"),
    ([[1], [2]], [0], [1, 1], "num_computed_tokens"),
    ([[1]], [0], [0], "num_scheduled_tokens"),
    ([[3, 9]], [-2], [3], "num_computed_tokens"),  # once positions [-2, -1, 0], slots wrapped
    ([[3, 9]], [1.0], [3], "num_computed_tokens"),  # once torch's NotImplementedError
    ([[3, 9]], [0], [2.0], "num_scheduled_tokens"),
    ([[3, 9]], [True], [1], "num_computed_tokens"),
    ([[-1, 9]], [0], [3], "block_tables"),
])
def test_prepare_metadata_refuses_bad_input(tables, computed, scheduled, field):
    with pytest.raises(ValueError, match=field):
        prepare_metadata(tables, computed, scheduled, block_size=4)


def test_prepare_metadata_refuses_a_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        prepare_metadata([[1]], [0], [1], block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        prepare_metadata([[1]], [0], [1], block_size=4.0)


def test_prepare_metadata_counts_the_longest_lengths_on_the_host():
    mixed = prepare_metadata([[3, 9], [4, 7]], [6, 0], [1, 5], block_size=4)
    assert (mixed.max_seqlen_q, mixed.max_seqlen_k, mixed.is_decode) == (5, 7, False)
    decode = prepare_metadata([[3, 9], [4, 7]], [6, 2], [1, 1], block_size=4)
    assert (decode.max_seqlen_q, decode.max_seqlen_k, decode.is_decode) == (1, 7, True)
    assert all(isinstance(v, int) for v in (decode.max_seqlen_q, decode.max_seqlen_k))


def test_prepare_metadata_refuses_two_tokens_in_one_slot():
    # Two sequences writing the same block would race in the store kernel on a GPU.
    with pytest.raises(ValueError, match="slot"):
        prepare_metadata([[3], [3]], [0, 0], [2, 2], block_size=4)
    shared_prefix = prepare_metadata([[3, 5], [3, 6]], [4, 4], [1, 1], block_size=4)
    assert shared_prefix.slot_mapping.tolist() == [20, 24]  # a shared block is only read


def test_prepare_metadata_records_its_block_size():
    assert prepare_metadata([[1, 0]], [0], [5], block_size=4).block_size == 4
    assert prepare_metadata([[1]], [0], [5], block_size=8).block_size == 8


@pytest.mark.heavy  # seconds: every kernel under the interpreter
def test_padding_is_never_read_by_the_triton_kernels():
    """A pad entry naming a block full of NaN changes nothing: no pad is ever loaded."""
    torch.manual_seed(0)
    cache = torch.randn(4, 2, BLOCK_SIZE, 128)
    cache[3] = float("nan")  # block 3 is nobody's: only a pad read would reach it
    tables = [[2], [0, 1]]
    for computed, scheduled in (([1, 6], [1, 1]), ([0, 0], [2, 7])):  # decode, then extend
        metadata = prepare_metadata(tables, computed, scheduled, BLOCK_SIZE)
        query = torch.randn(metadata.num_tokens, 14, 64)
        padded_with_nan = metadata.block_tables.masked_fill(metadata.block_tables < 0, 3)
        outputs = [paged_attention(query, cache, t, metadata.seq_lens, metadata.query_start_loc,
                                   backend="triton")
                   for t in (metadata.block_tables, padded_with_nan)]
        assert outputs[0].isfinite().all()
        torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)


def test_the_torch_reference_fails_loudly_on_a_pad():
    """The -1 pad is a block no pool holds: the reference refuses a read that reaches one."""
    cache = torch.randn(4, 2, BLOCK_SIZE, 128)
    tables = torch.tensor([[2, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the pool"):
        reference_paged_attention(torch.randn(1, 14, 64), cache, tables, torch.tensor([6]),
                                  torch.tensor([0, 1]))


# --- the forward pass against transformers ---------------------------------------------------

LENGTHS = [3, 17, 30]


@pytest.mark.heavy  # a second or more: make test runs it, make check does not
def test_prefill_logits_at_every_position(model, peer, config):
    prompts = make_prompts(LENGTHS, config.vocab_size)
    tables, num_blocks = scattered_tables(LENGTHS)
    outputs = run_schedule(model, prompts, tables, num_blocks, [[n] for n in LENGTHS])
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, reference_logits(peer, prompt), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_token_by_token_through_scattered_blocks(model, peer, config):
    prompts = make_prompts(LENGTHS, config.vocab_size, seed=1)
    tables, num_blocks = scattered_tables(LENGTHS, seed=1)
    outputs = run_schedule(model, prompts, tables, num_blocks, [[1] * n for n in LENGTHS])
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, reference_logits(peer, prompt), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # seconds: its fixtures build a model and the transformers peer
def test_chunked_prefill(model, peer, config):
    prompts = make_prompts(LENGTHS, config.vocab_size, seed=2)
    tables, num_blocks = scattered_tables(LENGTHS, seed=2)
    chunks = [[5] * (n // 5) + ([n % 5] if n % 5 else []) for n in LENGTHS]
    outputs = run_schedule(model, prompts, tables, num_blocks, chunks)
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, reference_logits(peer, prompt), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # over a second: make test runs it, make check does not
@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 1000))
def test_any_chunking_gives_the_prefill_logits(model, peer, config, chunks, seed):
    length = sum(chunks)
    prompts = make_prompts([length], config.vocab_size, seed=seed)
    tables, num_blocks = scattered_tables([length], seed=seed)
    (logits,) = run_schedule(model, prompts, tables, num_blocks, [chunks])
    torch.testing.assert_close(logits, reference_logits(peer, prompts[0]), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # seconds: builds the model and the transformers peer
def test_logits_indices_pick_the_last_token_of_each_sequence(model, peer, config):
    prompts = make_prompts([4, 9], config.vocab_size, seed=4)
    tables, num_blocks = scattered_tables([4, 9], seed=4)
    metadata = prepare_metadata(tables, [0, 0], [4, 9], BLOCK_SIZE)
    ids = torch.tensor(prompts[0] + prompts[1])
    logits = model(ids, metadata, new_cache(config, num_blocks))
    assert logits.shape == (2, config.vocab_size) and logits.dtype == torch.float32
    for row, prompt in zip(logits, prompts):
        torch.testing.assert_close(row, reference_logits(peer, prompt)[-1], atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # seconds: builds an untied model and its transformers peer
def test_untied_head(config):
    untied = ModelConfig.small(num_layers=1, vocab_size=128).to_hf_config()
    untied = ModelConfig.from_hf_config(untied | {"tie_word_embeddings": False})
    model = random_model(untied, seed=5)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    prompt = make_prompts([6], untied.vocab_size)[0]
    (logits,) = run_schedule(model, [prompt], [[0, 1]], 2, [[6]])
    torch.testing.assert_close(logits, reference_logits(to_transformers(model), prompt),
                               atol=TOLERANCE, rtol=0)


def greedy(model, prompt, max_new_tokens):
    num_blocks = -(-(len(prompt) + max_new_tokens) // BLOCK_SIZE)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(9)).tolist()
    cache, tokens, computed = new_cache(model.config, num_blocks), list(prompt), 0
    for _ in range(max_new_tokens):
        metadata = prepare_metadata([table], [computed], [len(tokens) - computed], BLOCK_SIZE)
        logits = model(torch.tensor(tokens[computed:]), metadata, cache)
        computed = len(tokens)
        tokens.append(int(logits[-1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_greedy_continuations_vary_and_match_generate(model, peer, config):
    for prompt in make_prompts([5, 12], config.vocab_size, seed=6):
        ours = greedy(model, prompt, 20)
        ids = torch.tensor([prompt])
        theirs = peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                               min_new_tokens=20, do_sample=False, pad_token_id=0)
        assert ours == theirs[0, len(prompt):].tolist()
        assert len(set(ours)) > 3  # the initialisation scale keeps greedy output from one token


@pytest.mark.heavy  # over a second: make test runs it, make check does not
def test_at_the_usual_scale_greedy_decoding_repeats_one_token():
    """The chapter's claim: at 0.02 the model falls into a fixed point, at 0.1 it does not.

    A decoder that ignores its cache varies even at 0.02, so the fixed point is not the
    model ignoring its context; what is wrong with 0.02 is only that a constant continuation
    agrees trivially."""
    small = ModelConfig.small()
    prompt = torch.randint(0, small.vocab_size, (7,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    at_002 = random_model(small, seed=0, initializer_range=0.02, attention_backend="torch")
    at_01 = random_model(small, seed=0, initializer_range=0.1, attention_backend="torch")
    assert len(set(greedy(at_002, prompt, 24))) == 1
    assert len(set(greedy(at_01, prompt, 24))) > 3
    without_cache, tokens = [], list(prompt)
    for _ in range(24):  # each step sees only the last token, as if the cache were empty
        metadata = prepare_metadata([[0]], [0], [1], BLOCK_SIZE)
        logits = at_002(torch.tensor(tokens[-1:]), metadata, new_cache(small, 1))
        tokens.append(int(logits[-1].argmax()))
        without_cache.append(tokens[-1])
    assert len(set(without_cache)) > 3


# --- weights ------------------------------------------------------------------------------

def random_transformers_model(config: ModelConfig, seed: int = 0):
    """transformers' own Qwen2 with every tensor (biases and norms too) drawn at random."""
    torch.manual_seed(seed)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config.to_hf_config()))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    return hf.eval()


@pytest.mark.heavy  # seconds: imports transformers and writes a checkpoint
def test_load_model_reads_a_transformers_checkpoint(tmp_path, config):
    hf = random_transformers_model(config)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and list(tmp_path.glob("*.safetensors"))
    model = load_model(tmp_path)
    assert model.config == config
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = make_prompts([11], config.vocab_size, seed=7)[0]
    tables, num_blocks = scattered_tables([11], seed=7)
    (logits,) = run_schedule(model, [prompt], tables, num_blocks, [[4, 4, 3]])
    torch.testing.assert_close(logits, reference_logits(hf, prompt), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_save_pretrained_is_read_by_transformers(tmp_path, model):
    save_pretrained(model, tmp_path)
    hf, info = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    again = load_model(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_load_model_in_another_dtype(tmp_path, model):
    save_pretrained(model, tmp_path)
    half = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_load_model_casts_a_bfloat16_checkpoint_with_no_lm_head(tmp_path, config):
    """The real checkpoint's case: bf16 on disk, the head tied and absent, fp16 wanted."""
    from safetensors import safe_open

    stored = random_model(config, seed=12, dtype=torch.bfloat16)
    save_pretrained(stored, tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert "model.layers.0.self_attn.q_proj.bias" in f.keys()
    loaded = load_model(tmp_path, dtype=torch.float16)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, a), b in zip(stored.state_dict().items(), loaded.state_dict().values()):
        assert b.dtype == torch.float16 and torch.equal(a.to(torch.float16), b), name


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_load_model_streams_the_checkpoint_one_tensor_at_a_time_on_the_host(tmp_path,
                                                                            monkeypatch):
    """No second copy of the model: the checkpoint's tensors are read on the host, each dropped
    before the next but one is read, and copied into weights allocated once in the target dtype."""
    stored = random_model(ModelConfig.small(num_layers=3), seed=5, dtype=torch.bfloat16)
    save_pretrained(stored, tmp_path)
    alive, most, devices = set(), [0], set()
    real_load_weights = Qwen2ForCausalLM.load_weights

    def watched(self, weights):
        def each():
            for name, tensor in weights:
                devices.add(tensor.device.type)
                alive.add(name)
                weakref.finalize(tensor, alive.discard, name)
                most[0] = max(most[0], len(alive))
                yield name, tensor
        real_load_weights(self, each())

    monkeypatch.setattr(Qwen2ForCausalLM, "load_weights", watched)
    loaded = load_model(tmp_path, dtype=torch.float16)
    assert devices == {"cpu"} and most[0] <= 2
    assert len(stored.hf_state_dict()) > 2 * most[0]  # a checkpoint of many tensors
    assert all(p.dtype == torch.float16 for p in loaded.parameters())
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # the head is not a copy


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_load_model_refuses_a_gpu_without_room_for_the_weights(monkeypatch):
    from minipaged.huggingface import check_room_for_weights

    with torch.device("meta"):
        qwen = Qwen2ForCausalLM(ModelConfig.from_hf_config(QWEN_CONFIG)).to(torch.float16)
    need = 494_032_768 * 2  # the real model's parameters in fp16, its tied head counted once
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 1, 15 * 2**30))
    with pytest.raises(ValueError, match=f"the weights need {need:,} bytes on cuda"):
        check_room_for_weights(qwen, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need, 15 * 2**30))
    check_room_for_weights(qwen, torch.device("cuda"))


def test_load_model_refuses_a_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_CONFIG))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(tmp_path)


def test_load_weights_refuses_unknown_wrong_and_missing_tensors(model, config):
    weights = model.hf_state_dict()
    fresh = Qwen2ForCausalLM(config)
    with pytest.raises(ValueError, match="no place"):
        fresh.load_weights(list(weights.items()) + [("model.extra.weight", torch.zeros(1))])
    wrong = dict(weights, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        fresh.load_weights(wrong.items())
    partial = {k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}
    with pytest.raises(ValueError, match="k_proj"):
        fresh.load_weights(partial.items())


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_hf_state_dict_uses_transformers_names(model, peer):
    assert set(model.hf_state_dict()) | {"lm_head.weight"} == set(peer.state_dict())


def test_functions_attached_to_classes_are_not_public_module_names():
    """Methods defined apart and attached later stay off the module's public surface."""
    public = {name for name, value in vars(minipaged.model).items()
              if inspect.isfunction(value) and not name.startswith("_")}
    for cls in (ModelConfig, Qwen2ForCausalLM):
        for attribute, value in vars(cls).items():
            function = getattr(value, "__func__", value)
            if inspect.isfunction(function) and function.__name__ != attribute:
                assert function.__name__ not in public, (cls.__name__, attribute)
                assert function.__name__.startswith("_"), (cls.__name__, attribute)
    assert callable(ModelConfig.from_hf_config) and callable(Qwen2ForCausalLM.load_weights)


# --- input checks ---------------------------------------------------------------------------

def test_forward_refuses_mismatched_inputs(model, config):
    metadata = prepare_metadata([[0]], [0], [2], BLOCK_SIZE)
    cache = new_cache(config, 1)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([1, 2, 3]), metadata, cache)
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([1, config.vocab_size]), metadata, cache)
    with pytest.raises(ValueError, match="input_ids must be a tensor of token ids"):
        model(torch.tensor([1.0, 2.0]), metadata, cache)  # once embedded as a type error
    with pytest.raises(ValueError, match="layers"):
        model(torch.tensor([1, 2]), metadata, KVCache(1, 1, BLOCK_SIZE, 2, 64))
    with pytest.raises(ValueError, match="KV heads"):
        model(torch.tensor([1, 2]), metadata, KVCache(2, 1, BLOCK_SIZE, 1, 64))


def filled_cache(config, num_blocks, block_size=BLOCK_SIZE):
    cache = KVCache(config.num_hidden_layers, num_blocks, block_size,
                    config.num_key_value_heads, config.head_dim)
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=generator))
    return cache


def faulty_steps():
    """(what is wrong, the field the error names, metadata) for five prompt tokens in [1, 0]."""
    good = prepare_metadata([[1, 0]], [0], [5], BLOCK_SIZE)
    tables = good.block_tables
    return [
        ("context shorter than the query", "seq_lens", replace(good, seq_lens=torch.tensor([3]))),
        ("table too narrow", "block_tables", replace(good, block_tables=tables[:, :1])),
        ("block outside the pool", "block_tables",
         replace(good, block_tables=torch.tensor([[1, 2]], dtype=torch.int32))),
        ("table rows for two sequences", "block_tables",
         replace(good, block_tables=tables.repeat(2, 1))),
        ("offsets that do not end at T", "query_start_loc",
         replace(good, query_start_loc=torch.tensor([0, 4]))),
        ("positions shifted", "positions", replace(good, positions=good.positions + 1)),
        ("a slot the table does not give", "slot_mapping",
         replace(good, slot_mapping=good.slot_mapping.flip(0))),
        ("float seq_lens", "seq_lens", replace(good, seq_lens=good.seq_lens.float())),
        ("logits index past the batch", "logits_indices",
         replace(good, logits_indices=torch.tensor([5]))),
        ("another block size", "block_size", replace(good, block_size=8)),
        ("a longest query the tensors deny", "max_seqlen_q", replace(good, max_seqlen_q=1)),
        ("a longest context the tensors deny", "max_seqlen_k", replace(good, max_seqlen_k=4)),
    ]


@pytest.mark.parametrize("case", range(len(faulty_steps())))
def test_a_refused_forward_leaves_the_cache_unchanged(model, config, case):
    """Every check runs before layer 0 writes: a refused step writes nothing."""
    what, field, metadata = faulty_steps()[case]
    cache = filled_cache(config, 2)
    before = [layer.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match=field):
        model(torch.arange(5), metadata, cache)
    for layer, saved in zip(cache.layers, before):
        assert torch.equal(layer, saved), what


def test_forward_refuses_two_tokens_in_one_slot(model, config):
    """Tables that agree with the slots, but hand one slot to two tokens: a race on a GPU."""
    metadata = prepare_metadata([[1], [0]], [0, 0], [2, 2], BLOCK_SIZE)
    both_in_block_1 = replace(metadata, block_tables=torch.tensor([[1], [1]], dtype=torch.int32),
                              slot_mapping=torch.tensor([4, 5, 4, 5]))
    cache = filled_cache(config, 2)
    before = [layer.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match="slot_mapping"):
        model(torch.arange(4), both_in_block_1, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.layers, before))


def test_forward_refuses_a_cache_of_another_block_size(model, config):
    """Metadata built for blocks of 4 on a cache of blocks of 8 once ran with wrong logits."""
    metadata = prepare_metadata([[1, 0]], [0], [5], BLOCK_SIZE)
    cache = filled_cache(config, 2, block_size=8)
    before = [layer.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match="block_size"):
        model(torch.arange(5), metadata, cache)
    assert all(torch.equal(a, b) for a, b in zip(cache.layers, before))


def test_slot_minus_one_is_still_accepted(model, config):
    """-1 in slot_mapping skips a token's write, as chapter 5's kernels allow."""
    metadata = prepare_metadata([[1, 0]], [0], [5], BLOCK_SIZE)
    skipped = replace(metadata, slot_mapping=torch.tensor([4, 5, 6, 7, -1]))
    cache = new_cache(config, 2)
    model(torch.arange(5), skipped, cache)
    assert not cache.layers[0][0].any() and cache.layers[0][1].any()


def test_refuses_unknown_backend_and_scale(config):
    with pytest.raises(ValueError, match="attention_backend"):
        Qwen2ForCausalLM(config, attention_backend="flash")
    with pytest.raises(ValueError, match="initializer_range"):
        random_model(config, initializer_range=0)


@pytest.mark.heavy  # a few tenths of a second or more: make test runs it, make check not
def test_metadata_is_a_plain_argument(model, config):
    """Two caches, two metadata objects, interleaved: nothing is shared through globals."""
    prompts = make_prompts([6, 6], config.vocab_size, seed=8)
    caches = [new_cache(config, 2), new_cache(config, 2)]
    last = []
    for prompt, cache in zip(prompts, caches):
        metadata = prepare_metadata([[1, 0]], [0], [6], BLOCK_SIZE)
        assert isinstance(metadata, AttentionMetadata)
        last.append(model(torch.tensor(prompt), metadata, cache))
    for prompt, logits in zip(prompts, last):
        (alone,) = run_schedule(model, [prompt], [[1, 0]], 2, [[6]])
        torch.testing.assert_close(logits[0], alone[-1])


# --- the Triton kernels under the interpreter ------------------------------------------------

@pytest.mark.heavy
def test_triton_backend_matches_torch():
    config = ModelConfig.small(num_layers=1, vocab_size=64, hidden_size=64, intermediate_size=64)
    triton_model = random_model(config, seed=11, attention_backend="triton")
    torch_model = random_model(config, seed=11, attention_backend="torch")
    prompt = make_prompts([5], config.vocab_size, seed=11)[0] + [0, 0]
    tables, num_blocks = scattered_tables([7], seed=11)
    chunks = [[5, 1, 1]]  # a prefill, then two decode steps
    (ours,) = run_schedule(triton_model, [prompt], tables, num_blocks, chunks)
    (reference,) = run_schedule(torch_model, [prompt], tables, num_blocks, chunks)
    torch.testing.assert_close(ours, reference, atol=TOLERANCE, rtol=0)


@pytest.mark.heavy
def test_layers_trust_the_step_checked_once(monkeypatch):
    """With the step's metadata checked by the model, no layer checks again (each check would
    wait for the GPU); the answer is the same as the torch reference's."""
    config = ModelConfig.small(num_layers=2, vocab_size=64, hidden_size=64, intermediate_size=64)
    triton_model = random_model(config, seed=12, attention_backend="triton")
    torch_model = random_model(config, seed=12, attention_backend="torch")

    def refuse(*args, **kwargs):
        raise AssertionError("a layer checked its inputs again")

    prompts = make_prompts([6, 3], config.vocab_size, seed=12)
    tables, num_blocks = scattered_tables([6, 4], seed=12)
    chunks = [[6], [2, 1]]  # a mixed step, then a decode
    (reference, other) = run_schedule(torch_model, prompts, tables, num_blocks, chunks)
    for name in ("check_attention_inputs", "check_store_inputs", "_check_unique_slots"):
        monkeypatch.setattr(minipaged.kernels, name, refuse)
    ours, theirs = run_schedule(triton_model, prompts, tables, num_blocks, chunks)
    torch.testing.assert_close(ours, reference, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(theirs, other, atol=TOLERANCE, rtol=0)


def test_first_divergence_finds_the_first_differing_token_or_a_length_mismatch():
    from minipaged.model import first_divergence
    assert first_divergence([[1, 2], [3, 4, 5]], [[1, 2], [3, 4, 5]]) is None
    assert first_divergence([[1, 2], [3, 9, 5]], [[1, 2], [3, 4, 6]]) == (1, 1)
    assert first_divergence([[1, 2, 3]], [[1, 2]]) == (0, 2)


@pytest.mark.heavy  # loads transformers' Qwen2 classes: seconds, the first time
def test_top2_margin_is_the_gap_between_transformers_two_best_logits(model, peer, config):
    from minipaged.model import top2_margin
    prompt = make_prompts([37], config.vocab_size, seed=3)[0]
    best = reference_logits(peer, prompt)[-1].topk(2).values
    assert top2_margin(model, prompt) == pytest.approx(float(best[0] - best[1]), abs=1e-4)


# --- the batched CPU path (chapter 5), what "auto" runs on a CPU --------------------------------

@pytest.fixture(scope="module")
def batched_model(config) -> Qwen2ForCausalLM:
    return random_model(config, seed=3, attention_backend="batched")  # the weights of `model`


def test_auto_on_a_cpu_is_the_batched_path(config):
    tiny = random_model(config, seed=3)
    assert tiny.attention_backend == "auto"
    assert minipaged.kernels.resolve_backend("auto", torch.zeros(1)) == "batched"


@pytest.mark.heavy  # its fixtures build a model and the transformers peer: seconds
@pytest.mark.parametrize("chunks", [
    [[3], [17], [30]],  # three prefills in one step
    [[1] * 3, [1] * 17, [1] * 30],  # decodes batched
    [[2, 1], [10, 7], [5, 5, 5, 15]],  # prefills, chunks and decodes mixed in each step
], ids=["prefill", "decode", "mixed"])
def test_batched_model_matches_transformers(batched_model, peer, config, chunks):
    prompts = make_prompts(LENGTHS, config.vocab_size, seed=7)
    tables, num_blocks = scattered_tables(LENGTHS, seed=7)
    outputs = run_schedule(batched_model, prompts, tables, num_blocks, chunks)
    for prompt, logits in zip(prompts, outputs):
        torch.testing.assert_close(logits, reference_logits(peer, prompt), atol=TOLERANCE, rtol=0)


@pytest.mark.heavy
@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=5), min_size=1, max_size=4),
       st.integers(0, 1000))
def test_batched_model_equals_the_reference_model_under_any_schedule(model, batched_model,
                                                                      config, chunks, seed):
    lengths = [sum(c) for c in chunks]
    prompts = make_prompts(lengths, config.vocab_size, seed=seed)
    tables, num_blocks = scattered_tables(lengths, seed=seed)
    ours = run_schedule(batched_model, prompts, tables, num_blocks, chunks)
    reference = run_schedule(model, prompts, tables, num_blocks, chunks)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


def test_batched_model_plans_once_per_step_and_layers_trust_it(batched_model, config,
                                                              monkeypatch):
    """Two layers, one plan per step; the checked step is not checked again in the layers."""
    plans = []
    original = minipaged.model.plan_batched_attention
    monkeypatch.setattr(minipaged.model, "plan_batched_attention",
                        lambda *args: plans.append(args) or original(*args))

    def refuse(*args, **kwargs):
        raise AssertionError("a layer checked its inputs again")

    monkeypatch.setattr(minipaged.kernels, "_check_batched_inputs", refuse)
    monkeypatch.setattr(minipaged.kernels, "plan_batched_attention", refuse)
    prompts = make_prompts([6, 3], config.vocab_size, seed=13)
    tables, num_blocks = scattered_tables([6, 4], seed=13)
    run_schedule(batched_model, prompts, tables, num_blocks, [[6], [2, 1]])
    assert len(plans) == 2  # two steps
