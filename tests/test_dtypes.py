"""Half-precision paths run and stay close to float32. Tolerance-based by nature (bfloat16 keeps
8 bits of mantissa), so kept apart from the exact float32 tests."""

import pytest
import torch

from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_checkpoint


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_logits_track_float32(tmp_path, dtype):
    from specserve.model.runner import ForwardBatch, ModelRunner

    folder = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    ref, half = load_model(folder, dtype="float32"), load_model(folder, dtype=dtype)
    assert half.model.dtype == getattr(torch, dtype)
    ids = [[3, 9, 17, 4, 22, 8, 5]]
    a = ModelRunner.dense(ref.model, 1, 32).execute(ForwardBatch([0], [0], ids, all_logits=True))
    b = ModelRunner.dense(half.model, 1, 32).execute(ForwardBatch([0], [0], ids, all_logits=True))
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05


def test_bfloat16_generation_with_speculation_runs(smollm_gguf_path):
    loaded = load_model(smollm_gguf_path, dtype="bfloat16")
    llm = LLM(loaded=loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=1)
    out = llm.chat([{"role": "user", "content": "Name a fruit."}], SamplingParams(temperature=0, max_tokens=12),
                   use_tqdm=False)[0]
    assert out.outputs[0].text.strip() and out.outputs[0].finish_reason in ("stop", "length")
