"""Sliding-window attention, per layer: a token at position p of a windowed layer sees the keys at
positions (p - window, p]. Checked against transformers past the window (float32 logits within
1e-4, greedy continuations exactly) with every layer windowed (Mistral) and with windowed and
global layers interleaved (Qwen2's layer_types), through the paths a step takes: chunked
prefill, prefix caching, token trees and speculation (greedy output == plain output), the padded
reference forward, and the native kernels. Which layers a config windows follows transformers;
a window nothing could honour is refused naming the field."""

import pytest
import torch

from specserve import native
from specserve.errors import ModelLoadError
from specserve.llm import LLM
from specserve.model.attention import DenseKVCache
from specserve.model.loader import load_model
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.sampling_params import SamplingParams
from tests.helpers import edit_config, generate_ids, make_tiny_checkpoint, ragged_prompts

TOL = 1e-4  # float32 logits against transformers' (test_model_golden.py)
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Mistral whose every layer attends through a window of 8 positions, and a Qwen2 of
    three layers whose middle one alone is windowed (6 positions)."""
    root = tmp_path_factory.mktemp("windows")
    mistral = edit_config(make_tiny_checkpoint(root / "mistral", vocab_size=64), model_type="mistral",
                          architectures=["MistralForCausalLM"], sliding_window=8)
    qwen2 = edit_config(make_tiny_checkpoint(root / "qwen2", "qwen2", vocab_size=64, layers=3), sliding_window=6,
                        use_sliding_window=True, layer_types=["full_attention", "sliding_attention", "full_attention"])
    return {"mistral": mistral, "qwen2": qwen2}


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


def test_configs_window_the_layers_transformers_does(folders):
    assert load_model(folders["mistral"]).config.window_layers == (0, 1)
    cfg = load_model(folders["qwen2"]).config
    assert (cfg.sliding_window, cfg.window_layers) == (6, (1,))


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_logits_past_the_window_match_transformers(folders, name):
    """Prefill of 29 tokens then decode steps, on the flattened path (paged, blocks of 4) and on
    the padded reference forward."""
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
        assert (flat - want).abs().max().item() <= TOL
        assert (padded - want).abs().max().item() <= TOL
        for pos in range(29, 36):
            nxt = int(want[-1].argmax())
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            want = ref(ids).logits[0]
            one = runner.execute(ForwardBatch([table], [pos], [[nxt]], all_logits=True))[0, 0]
            two = model.compute_logits(model(torch.tensor([[nxt]]), cache.metadata([0], [pos], [1]), cache))[0, 0]
            assert (one - want[-1]).abs().max().item() <= TOL
            assert (two - want[-1]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_greedy_continuation_past_the_window_equals_transformers(folders, name):
    """Chunked prefill (chunks of 7 tokens) and prefix caching (the prompts share a long prefix)
    change nothing: each token still sees its window."""
    shared = ragged_prompts(1, seed=4, lo=20, hi=21)[0]
    prompts = [shared + [5, 9], shared + [7], ragged_prompts(1, seed=5, lo=25, hi=26)[0]]
    ref = _reference(folders[name])
    want = [_reference_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    whole = LLM(folders[name], dtype="float32", max_num_seqs=3, block_size=4)
    chunked = LLM(folders[name], dtype="float32", max_num_seqs=3, block_size=4, max_num_batched_tokens=7)
    assert generate_ids(whole, prompts, GREEDY) == want
    assert generate_ids(chunked, prompts, GREEDY) == want
    assert generate_ids(chunked, prompts, GREEDY) == want  # again: the prefix cache holds them now


@pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_native_chunked_prefill_and_prefix_hits_give_the_whole_prompt_s_tokens(folders, name):
    """Exact on the native kernels (a token's row depends on its inputs alone): a prompt in
    chunks of 7, or after a prefix-cache hit, gives the tokens of one whole-prompt pass."""
    shared = ragged_prompts(1, seed=4, lo=20, hi=21)[0]
    prompts = [shared + [5, 9], shared + [7], ragged_prompts(1, seed=5, lo=25, hi=26)[0]]
    loaded = load_model(folders[name], quantization="int8")
    whole = [generate_ids(LLM(loaded=loaded, max_num_seqs=1, block_size=4), [p], GREEDY)[0] for p in prompts]
    chunked = LLM(loaded=loaded, max_num_seqs=3, block_size=4, max_num_batched_tokens=7)
    assert generate_ids(chunked, prompts, GREEDY) == whole
    assert generate_ids(chunked, prompts, GREEDY) == whole  # again: the prefix cache holds them now


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_greedy_speculation_past_the_window_equals_plain(folders, quantization):
    """n-gram chains and trees verified past the window: a tree node's keys are its ancestors'
    positions, not their slots, so deep branches see their own windows."""
    if quantization != "none" and native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    prompts = ragged_prompts(4, seed=3, lo=12, hi=40)
    plain = generate_ids(LLM(folders["qwen2"], quantization=quantization, max_num_seqs=4), prompts, GREEDY)
    for spec in ({"method": "ngram", "num_speculative_tokens": 5},
                 {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 3}):
        llm = LLM(folders["qwen2"], quantization=quantization, max_num_seqs=4, speculative_config=spec)
        assert generate_ids(llm, prompts, GREEDY) == plain, spec


@pytest.mark.parametrize("changes, layers", [
    # Without layer_types (older configs), the flag and max_window_layers decide.
    ({"sliding_window": 8, "use_sliding_window": False, "layer_types": None}, ()),  # Qwen2's usual: the key alone
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0, "layer_types": None}, (0, 1)),
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1, "layer_types": None}, (1,)),
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2, "layer_types": None}, ()),
    # layer_types, where given, decides (as in transformers).
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}, ()),
    ({"sliding_window": 8, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]}, (1,)),
    ({"sliding_window": None, "use_sliding_window": True}, ()),
])
def test_which_qwen2_layers_are_windowed(tmp_path, changes, layers):
    import transformers

    folder = edit_config(make_tiny_checkpoint(tmp_path / "q", "qwen2", vocab_size=64), **changes)
    hf = transformers.AutoConfig.from_pretrained(folder)
    assert tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention" and hf.sliding_window) == layers
    cfg = load_model(folder).config
    assert cfg.window_layers == layers and cfg.sliding_window == (8 if layers else None)


def test_llama_ignores_the_key_as_transformers_does(tmp_path):
    folder = edit_config(make_tiny_checkpoint(tmp_path / "l", vocab_size=64), sliding_window=8)
    assert load_model(folder).config.sliding_window is None


@pytest.mark.parametrize("changes, field", [
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": "8"}, "sliding_window"),
    ({"sliding_window": 8, "use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 8, "use_sliding_window": True, "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types"),
    # transformers has no window for these layers then, and fails at its first pass.
    ({"sliding_window": 8, "use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]},
     "use_sliding_window"),
])
def test_malformed_window_fields_are_refused_naming_them(tmp_path, changes, field):
    folder = edit_config(make_tiny_checkpoint(tmp_path / "q", "qwen2", vocab_size=64), **changes)
    with pytest.raises(ModelLoadError, match=f"invalid {field}="):
        load_model(folder)
