"""Numerical reference: the project's model against transformers on the same weights (float32)."""

import pytest
import torch

from specserve.model.attention import DenseKVCache
from specserve.model.hf_loader import load_hf_model, read_hf_config
from tests.helpers import make_tiny_checkpoint

TOL = 1e-4

CASES = {
    "llama-gqa": dict(kind="llama", heads=4, kv_heads=2),
    "llama-mha-llama3-rope": dict(kind="llama", heads=4, kv_heads=4, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(kind="llama", heads=4, kv_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-qkv-bias": dict(kind="qwen2", heads=4, kv_heads=2),
    "tied-embeddings": dict(kind="llama", heads=4, kv_heads=2, tied=True),
}


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers_prefill_and_20_decode_steps(tmp_path, name):
    import transformers

    folder = make_tiny_checkpoint(tmp_path / name, **CASES[name])
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = read_hf_config(folder)
    model = load_hf_model(folder, cfg, torch.float32, "cpu")
    if name == "qwen2-qkv-bias":
        assert model.layers[0].self_attn.qkv_proj.bias is not None
    if name == "tied-embeddings":
        assert model.lm_head.weight is model.embed_tokens.weight

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, 37), generator=g)
    cache = DenseKVCache(cfg.num_layers, 1, 128, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        out = ref(prompt, use_cache=True)
        mine = model.compute_logits(model(prompt, cache.metadata([0], [0], [37]), cache))
        assert (mine - out.logits).abs().max().item() <= TOL
        past, ids, pos = out.past_key_values, prompt, 37
        for _ in range(20):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            out = ref(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            mine = model.compute_logits(model(nxt, cache.metadata([0], [pos], [1]), cache))
            assert (mine - out.logits).abs().max().item() <= TOL
            ids, pos = torch.cat([ids, nxt], 1), pos + 1


def test_batched_ragged_forward_equals_single(tmp_path):
    """Rows of a padded batch (ragged lengths, different slots) compute what each would alone.

    Tolerance, not equality: the matrix kernels accumulate in an order that depends on the
    number of rows, so batched and single results differ by float32 rounding."""
    folder = make_tiny_checkpoint(tmp_path / "m", kind="llama")
    cfg = read_hf_config(folder)
    model = load_hf_model(folder, cfg, torch.float32, "cpu")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 8)]
    cache = DenseKVCache(cfg.num_layers, 3, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    ids = torch.zeros(3, 11, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    with torch.no_grad():
        batched = model.compute_logits(model(ids, cache.metadata([2, 0, 1], [0, 0, 0], [5, 11, 8]), cache))
        for i, s in enumerate(seqs):
            solo_cache = DenseKVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            solo = model.compute_logits(model(torch.tensor([s]), solo_cache.metadata([0], [0], [len(s)]), solo_cache))
            torch.testing.assert_close(batched[i, : len(s)], solo[0], atol=1e-5, rtol=0)
