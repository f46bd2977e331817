"""Qwen3 and Phi-3 against transformers on the same tiny random weights: float32 logits
(tolerance, as test_model_golden.py) and greedy continuations (exact) on the torch path; the
native kernels on each (exact where a row's bits are defined, tolerance against the float
reference where int8 activations round); the same weights written as a GGUF load to the same
model; speculation on each (exact); and the settings specserve cannot honour refused by name."""

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from specserve import native
from specserve.errors import ModelLoadError
from specserve.hardware import machine
from specserve.llm import LLM
from specserve.model.attention import DenseKVCache
from specserve.model.loader import load_model
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.sampling_params import SamplingParams
from tests.helpers import (assert_native_rows_batch_invariant, edit_config, generate_ids, make_tiny_checkpoint,
                           make_varied_checkpoint, native_levels, ragged_prompts, write_gguf)

TOL = 1e-4  # float32 logits against transformers' (test_model_golden.py)

# Qwen3 with a head_dim (32) other than hidden / heads (16); with attention_bias, which puts
# biases on q, k, v and o; Phi-3 (fused qkv and gate/up in its checkpoint); Llama with
# attention_bias (its o bias too, as transformers has it).
CASES = {
    "qwen3": dict(kind="qwen3", head_dim=32),
    "qwen3-bias": dict(kind="qwen3", head_dim=16, attention_bias=True),
    "phi3": dict(kind="phi3"),
    "llama-attention-bias": dict(kind="llama", attention_bias=True),
}
LEVELS = [int(lvl) for lvl in native_levels()]  # generic .. the highest level the kernels run here
needs_native = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: make_varied_checkpoint(root / name, **case) for name, case in CASES.items()}


def _reference(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _reference_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' model, every step a full forward pass (no EOS rule)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers_prefill_and_decode(folders, name):
    ref = _reference(folders[name])
    loaded = load_model(folders[name], dtype="float32")
    cfg, model = loaded.config, loaded.model
    assert cfg.architecture == CASES[name]["kind"]
    if name == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 and cfg.q_size != cfg.hidden_size and not cfg.attention_bias
    if name.endswith("bias"):
        assert cfg.attention_bias and cfg.o_bias
    prompt = torch.randint(0, cfg.vocab_size, (1, 29), generator=torch.Generator().manual_seed(1))
    cache = DenseKVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        out = ref(prompt, use_cache=True)
        mine = model.compute_logits(model(prompt, cache.metadata([0], [0], [29]), cache))
        assert (mine - out.logits).abs().max().item() <= TOL
        past, pos = out.past_key_values, 29
        for _ in range(8):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            out = ref(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            mine = model.compute_logits(model(nxt, cache.metadata([0], [pos], [1]), cache))
            assert (mine - out.logits).abs().max().item() <= TOL
            pos += 1


@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_greedy_continuation_equals_transformers(folders, name):
    prompts = ragged_prompts(3, seed=2, lo=5, hi=30)
    ours = generate_ids(LLM(folders[name], max_num_seqs=3), prompts,
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ref = _reference(folders[name])
    assert ours == [_reference_greedy(ref, p, 12) for p in prompts]


def _spec_cases(draft):
    return [{"method": "ngram", "num_speculative_tokens": 4},
            {"method": "ngram", "num_speculative_tokens": 3, "num_branches": 3},
            {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}]


# Speculation's code is the same for every family (the logits tests above cover what differs);
# each family runs a chain, a tree and a draft model of its own kind once, one family per path,
# to keep the suite's time: qwen3 on the float32 torch path, phi3 on the native kernels.
@pytest.mark.parametrize("name, quantization", [("qwen3", "none"), ("phi3", "int8")])
def test_greedy_speculation_equals_plain(folders, tmp_path, name, quantization):
    """n-gram (a chain and a tree) and a draft model of the same family, smaller and of other
    weights: greedy output token for token the plain output."""
    if quantization != "none" and native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    draft = make_varied_checkpoint(tmp_path / "draft", CASES[name]["kind"], seed=7, layers=1)
    prompts = ragged_prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = generate_ids(LLM(folders[name], quantization=quantization, max_num_seqs=4), prompts, params)
    for spec in _spec_cases(draft):
        spec_llm = LLM(folders[name], quantization=quantization, max_num_seqs=4, speculative_config=spec)
        assert generate_ids(spec_llm, prompts, params) == plain, spec


# --- the native kernels --------------------------------------------------------------------


def _all_logits(loaded, ids):
    return ModelRunner.dense(loaded.model, 1, 64).execute(ForwardBatch([0], [0], [ids], all_logits=True))[0]


@needs_native
@pytest.mark.parametrize("name", ["qwen3", "qwen3-bias", "phi3"])
def test_native_int8_stays_close_to_the_float32_reference(folders, name):
    """Tolerance (test_native_model.py's int8 bound): the weights and activations round to int8."""
    ref, nat = load_model(folders[name], dtype="float32"), load_model(folders[name], quantization="int8")
    assert getattr(nat.model, "native", False)
    ids = [3, 9, 17, 4, 22, 8, 5, 40, 41, 2]
    a, b = _all_logits(ref, ids), _all_logits(nat, ids)
    assert ((a - b).norm() / a.norm()).item() < 0.15


@needs_native
@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_native_rows_are_batch_invariant_and_every_level_computes_the_same_bits(folders, name):
    """Exact: the q/k norms are per row, so a token's logits are the same bits alone, among
    draft tokens and next to another request, on every CPU level."""
    assert_native_rows_batch_invariant(load_model(folders[name], quantization="int8"), LEVELS)


# --- GGUF ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3", "qwen3-bias", "phi3"])
def test_a_float_gguf_loads_the_model_of_its_folder(folders, tmp_path, name):
    """Float32 GGUF on the torch path: the folder's logits within float rounding (the file
    stores rms_norm_eps as float32) and its greedy output exactly."""
    path = write_gguf(folders[name], tmp_path / f"{name}.gguf", quantized=False)
    a, b = load_model(folders[name], dtype="float32"), load_model(path, dtype="float32")
    assert (a.config.qk_norm, a.config.attention_bias, a.config.o_bias, a.config.head_dim) == (
        b.config.qk_norm, b.config.attention_bias, b.config.o_bias, b.config.head_dim)
    ids = [3, 9, 17, 4, 22, 8, 5, 40, 41, 2]
    assert (_all_logits(a, ids) - _all_logits(b, ids)).abs().max().item() <= 1e-5
    prompts, params = ragged_prompts(3, seed=6), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert generate_ids(LLM(loaded=b, max_num_seqs=3), prompts, params) == generate_ids(
        LLM(loaded=a, max_num_seqs=3), prompts, params)


@needs_native
@pytest.mark.parametrize("name", ["qwen3", "phi3"])
def test_a_q8_0_gguf_computes_the_bits_of_its_folder_quantized_at_load(folders, tmp_path, name):
    """Exact: a Q8_0 GGUF (fused Phi-3 tensors split as blocks) runs on its own blocks, and the
    folder quantized to Q8_0 at load gives the same blocks (one quantizer), so the same logits."""
    path = write_gguf(folders[name], tmp_path / f"{name}.gguf", quantized=True)
    file, folder = load_model(path), load_model(folders[name], quantization="int8")
    assert getattr(file.model, "native", False) and "Q8_0" in file.kernels
    ids = [3, 9, 17, 4, 22, 8, 5, 40, 41, 2]
    assert torch.equal(_all_logits(file, ids), _all_logits(folder, ids))


# --- what specserve refuses ------------------------------------------------------------------


@pytest.mark.parametrize("changes, field", [
    ({"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.75}},
     "rope_parameters.partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"type": "su", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}}, "rope_scaling.type"),
    ({"rope_scaling": None, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "longrope",
                                                "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}},
     "rope_parameters.rope_type"),
])
def test_phi3_rope_variants_specserve_does_not_compute_are_refused_by_name(tmp_path, changes, field):
    folder = edit_config(make_tiny_checkpoint(tmp_path / "p", "phi3", vocab_size=64), **changes)
    with pytest.raises(ModelLoadError, match=rf"invalid {field}="):
        load_model(folder)


def test_phi3_sliding_window_past_the_window_equals_transformers(folders, tmp_path):
    import shutil

    folder = edit_config(shutil.copytree(folders["phi3"], tmp_path / "w"), sliding_window=12)
    loaded = load_model(folder, dtype="float32")
    assert (loaded.config.sliding_window, loaded.config.window_layers) == (12, (0, 1))
    ref = _reference(folder)
    assert ref.config.sliding_window == 12
    prompt = ragged_prompts(1, seed=8, lo=20, hi=21)[0]
    ours = generate_ids(LLM(loaded=loaded, max_num_seqs=1), [prompt],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert ours == _reference_greedy(ref, prompt, 12)


def test_gguf_partial_rope_and_longrope_are_refused_by_name(folders, tmp_path):
    partial = write_gguf(folders["phi3"], tmp_path / "partial.gguf", quantized=False,
                         meta={"phi3.rope.dimension_count": (12, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ModelLoadError, match=r"invalid phi3.rope.dimension_count=12"):
        load_model(partial)
    factors = np.ones(8, np.float32)
    longrope = write_gguf(folders["phi3"], tmp_path / "long.gguf", quantized=False,
                          extra_tensors={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(ModelLoadError, match=r"rope_factors_long.weight gives longrope"):
        load_model(longrope)
    no_q_norm = write_gguf(folders["qwen3"], tmp_path / "nonorm.gguf", quantized=False, drop=("blk.1.attn_q_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"missing.*blk.1.attn_q_norm.weight"):
        load_model(no_q_norm)


def test_a_checkpoint_with_fused_and_unfused_copies_is_refused(folders, tmp_path):
    import shutil
    from safetensors.torch import save_file

    folder = shutil.copytree(folders["phi3"], tmp_path / "twice")
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.gate_up_proj.weight"][128:].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="a second time"):
        load_model(folder)


def test_qwen3_config_without_head_dim_follows_transformers(tmp_path):
    """transformers' Qwen3 config gives head_dim 128 where config.json names none (not hidden / heads)."""
    import transformers

    folder = edit_config(make_tiny_checkpoint(tmp_path / "q", "qwen3", vocab_size=64, head_dim=128), head_dim=None)
    assert transformers.AutoConfig.from_pretrained(folder).head_dim == 128
    loaded = load_model(folder, dtype="float32")
    assert loaded.config.head_dim == 128
    ref = _reference(folder)
    ids = torch.tensor([[3, 9, 17, 4, 22]])
    with torch.no_grad():
        want = ref(ids).logits[0]
    assert (_all_logits(loaded, ids[0].tolist()) - want).abs().max().item() <= TOL
