"""The same guarantees on a CUDA device. These run only where a GPU is present (the project's
CPU-only CI skips them; they are run on a lent GPU machine and their results reported)."""

import pytest
import torch

from specserve.llm import LLM
from specserve.model.attention import DenseKVCache
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_logits_match_transformers_on_cuda(tmp_path):
    import transformers

    folder = make_tiny_checkpoint(tmp_path / "m", kind="qwen2")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    loaded = load_model(folder, dtype="float32", device="cuda")
    cfg = loaded.config
    ids = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(0)).cuda()
    cache = DenseKVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cuda")
    with torch.no_grad():
        mine = loaded.model.compute_logits(loaded.model(ids, cache.metadata([0], [0], [29]), cache))
        assert (mine - ref(ids).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_greedy_equals_plain_on_cuda(smollm_gguf_path, dtype):
    # TF32 (off by default in PyTorch) would round float32 matrix products to 10 mantissa bits.
    assert not torch.backends.cuda.matmul.allow_tf32
    loaded = load_model(smollm_gguf_path, dtype=dtype, device="cuda")
    msgs = [[{"role": "user", "content": p}] for p in (
        "Repeat exactly: red, green, blue, red, green, blue.", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=loaded, max_num_seqs=1).chat(msgs, params, use_tqdm=False)]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": str(smollm_gguf_path), "num_speculative_tokens": 3}):
        outs = LLM(loaded=loaded, max_num_seqs=2, speculative_config=spec).chat(msgs, params, use_tqdm=False)
        if dtype == "float32":
            assert [o.outputs[0].token_ids for o in outs] == plain
        assert LLM.aggregate_spec_stats(outs).num_accepted > 0
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=3)
    spec = LLM(loaded=loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert spec.chat(msgs, seeded, use_tqdm=False)[0].outputs[0].token_ids == \
        spec.chat(msgs, seeded, use_tqdm=False)[0].outputs[0].token_ids
