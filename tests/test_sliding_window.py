"""Sliding-window attention: specserve computes full attention, so a model whose layers attend
through a window is served only for contexts the window never cuts (where the two agree), and
refused beyond them with a message naming the window, never run with the window ignored. How
each config spelling marks windowed layers follows transformers."""

import pytest
import torch

from specserve.errors import ModelLoadError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from tests.helpers import edit_config, make_tiny_checkpoint


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral whose every layer attends through a window of 8 positions."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("mistral") / "m", vocab_size=64)
    return edit_config(folder, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)


def test_a_window_shorter_than_the_context_is_refused_naming_it(mistral):
    with pytest.raises(ModelLoadError, match=r"sliding window of 8 positions.*--max-model-len 8"):
        load_model(mistral)
    with pytest.raises(ModelLoadError, match="sliding_window"):
        load_model(mistral, max_model_len=9)


def test_within_the_window_output_equals_transformers_windowed_model(mistral):
    import transformers

    loaded = load_model(mistral, dtype="float32", max_model_len=8)
    assert loaded.config.sliding_window == 8
    prompt = [5, 9, 17]
    ours = LLM(loaded=loaded, max_num_seqs=1).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    ref = transformers.AutoModelForCausalLM.from_pretrained(mistral, torch_dtype=torch.float32).eval()
    assert ref.config.sliding_window == 8
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[0, 3:].tolist()
    assert list(ours) == want


@pytest.mark.parametrize("changes, windowed", [
    # Without layer_types (older configs), the flag and max_window_layers decide.
    ({"sliding_window": 8, "use_sliding_window": False, "layer_types": None}, False),  # Qwen2's usual: the key alone
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0, "layer_types": None}, True),
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2, "layer_types": None}, False),
    # layer_types, where given, decides (as in transformers).
    ({"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0}, False),
    ({"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]}, True),
    ({"sliding_window": 8, "layer_types": ["full_attention", "full_attention"]}, False),
    ({"sliding_window": None, "use_sliding_window": True}, False),
])
def test_which_qwen2_configs_have_windowed_layers(tmp_path, changes, windowed):
    import transformers

    folder = edit_config(make_tiny_checkpoint(tmp_path / "q", "qwen2", vocab_size=64), **changes)
    assert ("sliding_attention" in transformers.AutoConfig.from_pretrained(folder).layer_types) == windowed
    if windowed:
        with pytest.raises(ModelLoadError, match="sliding window of 8"):
            load_model(folder)
        assert load_model(folder, max_model_len=8).config.sliding_window == 8
    else:
        assert load_model(folder).config.sliding_window is None


def test_llama_ignores_the_key_as_transformers_does(tmp_path):
    folder = edit_config(make_tiny_checkpoint(tmp_path / "l", vocab_size=64), sliding_window=8)
    assert load_model(folder).config.sliding_window is None


@pytest.mark.parametrize("changes, field", [
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": "8"}, "sliding_window"),
    ({"sliding_window": 8, "layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 8, "layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
])
def test_malformed_window_fields_are_refused_naming_them(mistral, tmp_path, changes, field):
    folder = tmp_path / "bad"
    folder.mkdir()
    for f in mistral.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelLoadError, match=f"invalid {field}="):
        load_model(edit_config(folder, **changes))
