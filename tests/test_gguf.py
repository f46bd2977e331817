"""The embedded SmolLM2 GGUF against transformers loading the same file."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from specserve.errors import ModelLoadError
from specserve.llm import LLM
from specserve.model.config import ModelConfig
from specserve.model.gguf_loader import _dequantized, _unpermute
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "Describe Paris, the capital of France, for a tourist."}]


def test_greedy_continuation_equals_transformers_on_same_gguf(smollm, hf_smollm):
    ids = smollm.tokenizer.encode_chat(MESSAGES)
    llm = LLM(loaded=smollm, max_num_seqs=1)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_smollm.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2)
    assert len(out.outputs[0].token_ids) == 32
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    assert "Paris" in out.outputs[0].text


def test_prefill_logits_as_accurate_as_transformers(smollm, hf_smollm):
    """Prefill logits of the 30-layer embedded model, judged against a float64 run of
    transformers on the same weights. Both float32 implementations sum in their own kernels'
    orders (specserve: oneDNN-prepacked matrices, transformers: MKL), so each carries float32
    rounding, ~1e-5 RMS and ~1e-4 at worst on logits of ~30 after 30 layers. specserve's error
    must be of the same order as the reference's own (measured: 1.4x RMS, 1.7x max on the AMD
    EPYC; 1.7x RMS, 2.6x max on the Intel Xeon with AMX, whose oneDNN kernels block the sums
    differently). The max of ~1.5M errors is the noisier of the two figures, hence its wider bound."""
    import copy

    ids = smollm.tokenizer.encode_chat(MESSAGES)
    from specserve.model.attention import DenseKVCache
    cfg = smollm.config
    cache = DenseKVCache(cfg.num_layers, 1, 128, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        mine = smollm.model.compute_logits(smollm.model(torch.tensor([ids]), cache.metadata([0], [0], [len(ids)]), cache))
        ref32 = hf_smollm(torch.tensor([ids])).logits
        ref64 = copy.deepcopy(hf_smollm).double()(torch.tensor([ids])).logits
    err_mine, err_ref = mine.double() - ref64, ref32.double() - ref64
    assert (mine - ref32).abs().max().item() <= 5e-4
    assert err_mine.abs().max() <= 3 * err_ref.abs().max()
    assert err_mine.pow(2).mean().sqrt() <= 2 * err_ref.pow(2).mean().sqrt()
    assert torch.equal(mine.argmax(-1), ref64.argmax(-1))


def test_embedded_config_read_from_metadata(smollm):
    cfg = smollm.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantization(qtype):
    """Each required type dequantizes into [out, in] order; types the gguf package can quantize
    round-trip to within their quantization error, the K-quants (which it only dequantizes) are
    checked block-for-block on random block bytes."""
    rng = np.random.default_rng(0)
    t = GGMLQuantizationType[qtype]
    w = rng.standard_normal((4, 512)).astype(np.float32)
    try:
        data = quantize(w, t)
    except NotImplementedError:
        block, size = GGML_QUANT_SIZES[t]
        data = rng.integers(0, 256, (4, 512 // block * size), dtype=np.uint8)
        w = None

    class Tensor:  # the attributes the loader reads from a GGUFReader tensor
        name, tensor_type, shape = "blk.0.ffn_up.weight", t, [512, 4]

    Tensor.data = data
    got = _dequantized(Tensor)
    assert got.shape == (4, 512) and got.dtype == np.float32
    if w is None:
        for row in range(4):  # each row is its own run of blocks
            np.testing.assert_array_equal(got[row], dequantize(data[row:row + 1], t).reshape(-1))
    else:
        bound = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02}.get(qtype, 0.5)
        assert np.abs(got - w).max() <= bound


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of head_dim 4
    # llama.cpp's converter: rows of each head reordered from [x1 half, x2 half] to interleaved pairs.
    permuted = w.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(8, 3)
    np.testing.assert_array_equal(_unpermute(permuted, 2), w)


def test_missing_and_corrupt_files_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty cache, whatever this machine's holds
    with pytest.raises(ModelLoadError, match="does not exist") as e:
        load_model(tmp_path / "nope.gguf")
    assert "Hub" not in str(e.value)
    with pytest.raises(ModelLoadError, match="Hub id, and it is not in the local Hugging Face cache .*specserve never "
                                             "downloads weights: give a local path.*huggingface-cli download "
                                             "HuggingFaceTB/SmolLM2-360M-Instruct"):
        load_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(bad)
    empty_dir = tmp_path / "folder"
    empty_dir.mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(empty_dir)


@pytest.mark.parametrize("endianess", ["little", "big"])
def test_metadata_arrays_read_whole_equal_the_gguf_package(tmp_path, endianess):
    """open_gguf reads metadata arrays whole (a vocabulary took seconds element by element):
    every field's contents and types equal the gguf package's own reader, strings with
    multi-byte characters, numeric and empty arrays, arrays of arrays, either byte order."""
    import gguf

    from specserve.model.gguf_loader import open_gguf

    path = tmp_path / f"{endianess}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=getattr(gguf.GGUFEndian, endianess.upper()))
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "", "héllo", "日本語 🚀", "a" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0])
    writer.add_array("tokenizer.ggml.token_type", [1, 3, 6])
    writer.add_array("x.empty", [])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_string("x.text", "plain")
    writer.add_uint32("x.number", 7)
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, f in ours.fields.items():
        assert (f.contents(), f.types) == (theirs.fields[key].contents(), theirs.fields[key].types), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[3] == "日本語 🚀"
    assert len(ours.fields["tokenizer.ggml.tokens"].data) == 5
    assert [t.name for t in ours.tensors] == ["token_embd.weight"]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)
    data = path.read_bytes()  # a string's length running past the end of the file: a clear error
    cut = data.index(b"a" * 300)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[:cut + 10])
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_gguf(truncated)
    scores = data.index(np.array([0.5, -1.25, 3.0], dtype=np.dtype(np.float32).newbyteorder(
        "<" if endianess == "little" else ">")).tobytes())
    truncated.write_bytes(data[:scores + 8])  # a numeric array cut after two of its three values
    with pytest.raises(ModelLoadError, match="runs past the end of the file"):
        open_gguf(truncated)


def test_unsupported_architecture_and_quantization_are_named(tmp_path):
    import gguf

    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'phi2' is not supported"):
        load_model(path)
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt2'"):
        ModelConfig.from_hf_dict({"model_type": "gpt2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 2})

    class Tensor:
        name, tensor_type, shape = "blk.0.ffn_up.weight", GGMLQuantizationType.Q8_1, [32, 1]
        data = np.zeros((1, 36), dtype=np.uint8)

    with pytest.raises(ModelLoadError, match="quantization type Q8_1"):
        _dequantized(Tensor)


def test_a_hub_id_in_the_local_hugging_face_cache_loads_from_it(tiny, tmp_path, monkeypatch):
    """org/name loads the snapshot a Hugging Face download left in the cache (refs/main's
    revision), and nothing is fetched."""
    import shutil

    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(tiny["target"], repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old000").mkdir()  # another revision, not the one refs/main names
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("acme/tiny-llama")
    assert loaded.config.vocab_size == tiny["loaded"].config.vocab_size
    assert loaded.config.num_layers == tiny["loaded"].config.num_layers
