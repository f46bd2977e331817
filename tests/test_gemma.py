"""Gemma 2 and Gemma 3 (text) against transformers on tiny random weights: float32 logits within
1e-4 over a prefill and decode steps, greedy continuations exactly (torch path); the same weights
as a GGUF (norms stored as 1 + w, llama.cpp's names and keys) load to the same model; the native
kernels (GeGLU, sandwich norms, soft-capping, local RoPE tables, windows) stay close to the
float reference, compute a token's bits alone whatever shares its pass, and equal bits at every
CPU level; speculation keeps greedy output exactly plain output; settings specserve does not
compute are refused by name.

The tiny models exercise what differs from Llama: Gemma 2 with soft-capping tight enough to bite
(attention 3, final 5), a window of 6 on its alternate layers, query_pre_attn_scalar other than
head_dim and tied embeddings; Gemma 3 with per-head q/k norms, three layers of which the first
two are windowed (6) and use their own RoPE base (10^4 against 10^6)."""

import json
import shutil

import pytest
import torch

from specserve import native
from specserve.errors import ModelLoadError
from specserve.llm import LLM
from specserve.model.attention import DenseKVCache
from specserve.model.loader import load_model
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.sampling_params import SamplingParams
from tests.helpers import (assert_native_rows_batch_invariant, edit_config, generate_ids, make_varied_checkpoint,
                           native_levels, ragged_prompts, write_gguf)

TOL = 1e-4  # float32 logits against transformers' (test_model_golden.py)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CASES = {
    "gemma2": dict(kind="gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=6, tied=True,
                   attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma3": dict(kind="gemma3", head_dim=32, query_pre_attn_scalar=24, sliding_window=6, layers=3,
                   sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=1e4),
}
LEVELS = [int(lvl) for lvl in native_levels()]
needs_native = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {name: make_varied_checkpoint(root / name, **case) for name, case in CASES.items()}


def _reference(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model, every step a full forward pass (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _all_logits(loaded, ids):
    return ModelRunner.paged(loaded.model, 16, 4).execute(ForwardBatch([list(range(16))], [0], [ids],
                                                                       all_logits=True))[0]


def test_configs_read_what_transformers_does(folders):
    g2, g3 = load_model(folders["gemma2"]).config, load_model(folders["gemma3"]).config
    assert (g2.window_layers, g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.tie_word_embeddings,
            g2.query_pre_attn_scalar, g2.local_rope_theta) == ((0,), 3.0, 5.0, True, 24, None)
    assert (g3.window_layers, g3.attn_logit_softcapping, g3.final_logit_softcapping, g3.qk_norm, g3.rope_theta,
            g3.local_rope_theta) == ((0, 1), None, None, True, 1e6, 1e4)
    assert g2.sandwich_norms and g2.embed_scale and g2.activation == "gelu_tanh"


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers_prefill_and_decode(folders, name):
    """29 tokens of prefill then decode steps past the window, on the flattened path (paged,
    blocks of 4) and on the padded reference forward."""
    ref = _reference(folders[name])
    loaded = load_model(folders[name], dtype="float32")
    model, cfg = loaded.model, loaded.config
    ids = torch.randint(2, 64, (1, 29), generator=torch.Generator().manual_seed(1))
    runner = ModelRunner.paged(model, 16, 4)
    cache = DenseKVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = list(range(16))
    with torch.no_grad():
        want = ref(ids).logits[0]
        flat = runner.execute(ForwardBatch([table], [0], [ids[0].tolist()], all_logits=True))[0]
        padded = model.compute_logits(model(ids, cache.metadata([0], [0], [29]), cache))[0]
        assert (flat - want).abs().max().item() <= TOL and (padded - want).abs().max().item() <= TOL
        for pos in range(29, 37):
            nxt = int(want[-1].argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            want = ref(ids).logits[0]
            one = runner.execute(ForwardBatch([table], [pos], [[nxt]], all_logits=True))[0, 0]
            two = model.compute_logits(model(torch.tensor([[nxt]]), cache.metadata([0], [pos], [1]), cache))[0, 0]
            assert (one - want[-1]).abs().max().item() <= TOL and (two - want[-1]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", CASES)
def test_greedy_continuation_equals_transformers(folders, name):
    prompts = ragged_prompts(3, seed=2, lo=5, hi=30)
    ours = generate_ids(LLM(folders[name], dtype="float32", max_num_seqs=3), prompts, GREEDY)
    ref = _reference(folders[name])
    assert ours == [_reference_greedy(ref, p, GREEDY.max_tokens) for p in prompts]


def _spec_cases(draft):
    return [{"method": "ngram", "num_speculative_tokens": 4},
            {"method": "ngram", "num_speculative_tokens": 3, "num_branches": 3},
            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}]


@pytest.mark.parametrize("name, quantization", [("gemma2", "none"), ("gemma3", "none"), ("gemma2", "int8"),
                                                ("gemma3", "int8")])
def test_greedy_speculation_equals_plain(folders, tmp_path, name, quantization):
    """n-gram (a chain and a tree) and a draft model of the same family (one layer, other
    weights): greedy output token for token the plain output, on each path."""
    if quantization != "none" and native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    draft = make_varied_checkpoint(tmp_path / "draft", **(CASES[name] | dict(layers=1, seed=7)))
    prompts = ragged_prompts(4, seed=3, lo=4, hi=40)
    plain = generate_ids(LLM(folders[name], quantization=quantization, max_num_seqs=4), prompts, GREEDY)
    for spec in _spec_cases(draft):
        spec_llm = LLM(folders[name], quantization=quantization, max_num_seqs=4, speculative_config=spec)
        assert generate_ids(spec_llm, prompts, GREEDY) == plain, spec


# --- the native kernels --------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("name", CASES)
def test_native_int8_stays_close_to_the_float32_reference(folders, name):
    """Tolerance (test_native_model.py's int8 bound): the weights and activations round to int8."""
    ref, nat = load_model(folders[name], dtype="float32"), load_model(folders[name], quantization="int8")
    assert getattr(nat.model, "native", False)
    ids = ragged_prompts(1, seed=9, lo=20, hi=21)[0]
    a, b = _all_logits(ref, ids), _all_logits(nat, ids)
    assert ((a - b).norm() / a.norm()).item() < 0.15


@needs_native
@pytest.mark.parametrize("name", CASES)
def test_native_rows_are_batch_invariant_and_every_level_computes_the_same_bits(folders, name):
    """Exact: past the window, a token's logits are the same bits alone, among draft tokens and
    next to another request, on every CPU level."""
    assert_native_rows_batch_invariant(load_model(folders[name], quantization="int8"), LEVELS)


# --- GGUF ------------------------------------------------------------------------------------


def _as_llama_cpp_reads(folder, tmp_path):
    """The folder with query_pre_attn_scalar = head_dim: a GGUF has no key for it, and llama.cpp
    takes head_dim (hidden / heads for the 27B models)."""
    copy = shutil.copytree(folder, tmp_path / "as_gguf")
    cfg = json.loads((copy / "config.json").read_text())
    return edit_config(copy, query_pre_attn_scalar=cfg["head_dim"])


@pytest.mark.parametrize("name", CASES)
def test_a_float_gguf_loads_the_model_of_its_folder(folders, tmp_path, name):
    """Float32 GGUF on the torch path: the folder's logits within float rounding (norms stored
    as 1 + w, eps as float32) and its greedy output exactly."""
    folder = _as_llama_cpp_reads(folders[name], tmp_path)
    path = write_gguf(folder, tmp_path / f"{name}.gguf", quantized=False)
    a, b = load_model(folder, dtype="float32"), load_model(path, dtype="float32")
    for key in ("window_layers", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping",
                "local_rope_theta", "query_pre_attn_scalar", "qk_norm", "tie_word_embeddings"):
        assert getattr(a.config, key) == getattr(b.config, key), key
    ids = ragged_prompts(1, seed=9, lo=20, hi=21)[0]
    assert (_all_logits(a, ids) - _all_logits(b, ids)).abs().max().item() <= 1e-5
    prompts = ragged_prompts(3, seed=6)
    assert generate_ids(LLM(loaded=b, max_num_seqs=3), prompts, GREEDY) == generate_ids(
        LLM(loaded=a, max_num_seqs=3), prompts, GREEDY)


@needs_native
@pytest.mark.parametrize("name", CASES)
def test_a_q8_0_gguf_computes_the_bits_of_its_folder_quantized_at_load(folders, tmp_path, name):
    """Exact: a Q8_0 GGUF runs on its own blocks, and the folder quantized to Q8_0 at load gives
    the same blocks (one quantizer) and the same (1 + w) norms, so the same logits."""
    folder = _as_llama_cpp_reads(folders[name], tmp_path)
    path = write_gguf(folder, tmp_path / f"{name}.gguf", quantized=True)
    file, quantized = load_model(path), load_model(folder, quantization="int8")
    assert getattr(file.model, "native", False) and "Q8_0" in file.kernels
    ids = ragged_prompts(1, seed=9, lo=20, hi=21)[0]
    assert torch.equal(_all_logits(file, ids), _all_logits(quantized, ids))


# --- what specserve refuses ------------------------------------------------------------------


@pytest.mark.parametrize("name, changes, field", [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"model_type": "gemma3"}, "model_type"),
    ("gemma3", {"rope_local_base_freq": 0.5, "rope_parameters": None}, "rope_local_base_freq"),
])
def test_settings_specserve_does_not_compute_are_refused_by_name(folders, tmp_path, name, changes, field):
    folder = edit_config(shutil.copytree(folders[name], tmp_path / "bad"), **changes)
    with pytest.raises(ModelLoadError, match=f"invalid {field}="):
        load_model(folder)
