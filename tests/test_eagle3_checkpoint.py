"""EAGLE-3 drafter checkpoints: each published layout loads into canonical tensors that
Eagle3Head takes as they are, aux layers come from where each layout names them, specserve's own
files round-trip, and every kind of bad file is refused with one line naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve.spec.heads import eagle3_checkpoint
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_checkpoint import read_eagle3, write_eagle3
from specserve.spec.heads.eagle3_config import DRAFT_IDS, OWN_EMBEDDING, default_aux_layers
from tests.eagle3_layouts import (DRAFT_VOCAB, HIDDEN, LAYERS, VOCAB, target_config, write_eagle, write_json,
                                  write_specforge, write_speculators)
from tests.helpers import edit_config

TARGET = target_config()
# The default aux layers (2, L // 2, L - 3) repeat a layer below 7 layers: checkpoints that name
# none are read against a deeper target.
DEEP_LAYERS = 8
DEEP = target_config(layers=DEEP_LAYERS)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == (torch.int64 if name == DRAFT_IDS else torch.float32), name
        assert torch.equal(got[name], tensor), name


def loads_into_head(ckpt) -> None:
    """Eagle3Head takes the tensors under their names, strictly, and holds exactly them."""
    head = Eagle3Head(ckpt.config)
    head.load_state_dict({**ckpt.tensors}, strict=True)
    assert_same(dict(head.state_dict()), ckpt.tensors)


def refused(folder: Path, *needles: str, target=TARGET) -> str:
    with pytest.raises(ModelLoadError) as e:
        read_eagle3(folder, target)
    message = str(e.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def edit_tensors(folder: Path, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


# --- each layout loads -------------------------------------------------------------------------


def test_eagle_layout_loads_with_the_default_aux_layers(tmp_path):
    built = write_eagle(tmp_path / "eagle")
    ckpt = read_eagle3(built.folder, DEEP)
    assert ckpt.layout == "eagle" and ckpt.extra == {} and ckpt.own_embedding is None
    assert ckpt.config.aux_layers == default_aux_layers(DEEP_LAYERS) == (2, 4, 5)
    assert (ckpt.config.draft_vocab_size, ckpt.config.vocab_size, ckpt.config.target_hidden_size) == \
        (DRAFT_VOCAB, VOCAB, HIDDEN)
    # Left out of EAGLE's config: LlamaConfig's theta, and the raw feature stays the residual.
    assert ckpt.config.rope_theta == 10000.0 and not ckpt.config.norm_before_residual
    assert_same(ckpt.tensors, built.canonical)
    loads_into_head(ckpt)


def test_specforge_layout_reads_sglang_aux_layers_as_the_next_layers_entering_streams(tmp_path):
    built = write_specforge(tmp_path / "sf", aux_outputs=[0, 2, 4])
    ckpt = read_eagle3(built.folder, TARGET)
    assert ckpt.layout == "specforge"
    # SGLang reads layer i's output, the stream entering layer i + 1.
    assert ckpt.config.aux_layers == (1, 3, 5)
    assert ckpt.config.rope_theta == 500000.0
    assert_same(ckpt.tensors, built.canonical)
    loads_into_head(ckpt)


def test_specforge_layout_without_eagle_config_uses_the_default_aux_layers(tmp_path):
    ckpt = read_eagle3(write_specforge(tmp_path / "sf", aux_outputs=None).folder, DEEP)
    assert ckpt.config.aux_layers == default_aux_layers(DEEP_LAYERS)


def test_sharded_specforge_layout_loads_through_its_index(tmp_path):
    built = write_specforge(tmp_path / "sf", shards=3)
    assert not (built.folder / "model.safetensors").exists()
    ckpt = read_eagle3(built.folder, TARGET)
    assert_same(ckpt.tensors, built.canonical)
    loads_into_head(ckpt)


def test_speculators_layout_loads_with_its_embedding_and_vllm_aux_layers(tmp_path):
    built = write_speculators(tmp_path / "spec", aux=[2, 3, 5])
    ckpt = read_eagle3(built.folder, TARGET)
    assert ckpt.layout == "speculators"
    assert ckpt.config.aux_layers == (2, 3, 5)  # vLLM's convention is ours: no shift
    assert ckpt.config.norm_before_residual
    assert ckpt.config.target_hidden_size == HIDDEN  # null: the drafter's own width
    assert ckpt.config.rope_scaling["rope_type"] == "llama3"
    assert torch.equal(ckpt.own_embedding, built.own_embedding)
    assert OWN_EMBEDDING not in ckpt.tensors
    assert_same(ckpt.tensors, built.canonical)
    loads_into_head(ckpt)


def test_speculators_layout_without_aux_ids_uses_vllms_default(tmp_path):
    ckpt = read_eagle3(write_speculators(tmp_path / "spec", aux=None).folder, DEEP)
    assert ckpt.config.aux_layers == default_aux_layers(DEEP_LAYERS)


def test_full_vocabulary_head_may_leave_out_d2t(tmp_path):
    built = write_specforge(tmp_path / "sf")
    edit_config(built.folder, draft_vocab_size=VOCAB)
    g = torch.Generator().manual_seed(5)

    def full_head(t):
        del t["d2t"], t["t2d"]
        t["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)

    edit_tensors(built.folder, full_head)
    ckpt = read_eagle3(built.folder, TARGET)
    assert torch.equal(ckpt.tensors[DRAFT_IDS], torch.arange(VOCAB))
    loads_into_head(ckpt)


# --- specserve's own files -----------------------------------------------------------------------


def test_write_eagle3_round_trips_and_reads_as_specforge_and_vllm_would(tmp_path):
    source = read_eagle3(write_speculators(tmp_path / "spec", aux=[1, 3, 4]).folder, TARGET)
    extra = {"target": {"name": "tiny-llama", "num_layers": LAYERS}, "training": {"steps": 12, "loss": 0.5}}
    tensors = {**source.tensors, OWN_EMBEDDING: source.own_embedding}
    write_eagle3(tmp_path / "ours", source.config, tensors, extra)
    ckpt = read_eagle3(tmp_path / "ours", TARGET)
    assert ckpt.layout == "specserve" and ckpt.extra == extra and ckpt.config == source.config
    assert_same(ckpt.tensors, source.tensors)
    assert torch.equal(ckpt.own_embedding, source.own_embedding)
    loads_into_head(ckpt)
    # What other engines read: SpecForge's names and d2t/t2d, the aux layers in each one's convention.
    doc = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert doc["architectures"] == ["LlamaForCausalLMEagle3"]
    assert doc["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: entering streams
    assert doc["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: layer outputs
    names = set(load_file(str(tmp_path / "ours" / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight", "d2t", "t2d"} <= names
    # Without the specserve object the same files read as SpecForge's, to the same drafter.
    edit_config(tmp_path / "ours", specserve=None)
    other = read_eagle3(tmp_path / "ours", TARGET)
    assert other.layout == "specforge" and other.config == source.config
    assert_same(other.tensors, source.tensors)


def test_write_eagle3_will_not_leave_stale_shards_beside_its_weights(tmp_path):
    built = write_specforge(tmp_path / "sf", shards=2)
    ckpt = read_eagle3(built.folder, TARGET)
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        write_eagle3(built.folder, ckpt.config, ckpt.tensors, {})
    assert not (built.folder / "model.safetensors").exists()


def test_folder_without_config_is_refused(tmp_path):
    refused(tmp_path, "has no config.json")


def test_specserve_aux_layers_must_agree_with_what_other_engines_read(tmp_path):
    source = read_eagle3(write_eagle(tmp_path / "eagle").folder, DEEP)
    write_eagle3(tmp_path / "ours", source.config, source.tensors, {})
    edit_config(tmp_path / "ours", eagle_aux_hidden_state_layer_ids=[1, 3, 4],
                eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 3]})
    refused(tmp_path / "ours", "eagle_aux_hidden_state_layer_ids", "specserve.aux_layers", target=DEEP)


# --- bad files: one line each -----------------------------------------------------------------


def test_missing_tensor_is_named(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder
    edit_tensors(folder, lambda t: t.pop("midlayer.hidden_norm.weight"))
    refused(folder, "missing", "midlayer.hidden_norm.weight")


def test_wrong_shape_is_refused_from_the_header_before_any_data_is_read(tmp_path, monkeypatch):
    folder = write_speculators(tmp_path / "spec").folder
    edit_tensors(folder, lambda t: t.update({"layers.0.self_attn.k_proj.weight": torch.zeros(32, HIDDEN)}))
    opened = []

    def spy_open(path, framework):
        handle = real_open(path, framework=framework)
        opened.append(handle)
        return _NoData(handle)

    real_open = eagle3_checkpoint.safe_open
    monkeypatch.setattr(eagle3_checkpoint, "safe_open", spy_open)
    refused(folder, "layers.0.self_attn.k_proj.weight", "(32, 64)", "(32, 128)")
    assert opened


class _NoData:
    """A safetensors handle whose headers read and whose data does not."""

    def __init__(self, handle):
        self._handle = handle

    def keys(self):
        return self._handle.keys()

    def get_slice(self, name):
        return _Shape(self._handle.get_slice(name))

    def get_tensor(self, name):
        raise AssertionError(f"tensor data of {name} read before every header was checked")


class _Shape:
    def __init__(self, part):
        self._part = part

    def get_shape(self):
        return self._part.get_shape()

    def get_dtype(self):
        return self._part.get_dtype()


def test_huge_sizes_in_config_are_refused_before_allocation(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder
    edit_config(folder, intermediate_size=2**40)
    refused(folder, "config.json", "intermediate_size=1099511627776")
    edit_config(folder, intermediate_size=128, draft_vocab_size=10**12)
    refused(folder, "draft_vocab_size=1000000000000")
    # Within the caps, a drafter 65536 wide: the headers disagree, nothing is built.
    edit_config(folder, draft_vocab_size=DRAFT_VOCAB, hidden_size=65536, target_hidden_size=HIDDEN,
                head_dim=16)
    refused(folder, "fc.weight", "(65536, 192)")
    folder2 = write_speculators(tmp_path / "spec").folder
    doc = json.loads((folder2 / "config.json").read_text())
    doc["transformer_layer_config"]["num_attention_heads"] = 10**9
    write_json(folder2 / "config.json", doc)
    refused(folder2, "transformer_layer_config.num_attention_heads=1000000000")


def test_d2t_outside_the_vocabulary_is_refused(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder

    def out_of_range(t):
        t["d2t"][7] = VOCAB - 7  # row 7 -> target id 500
        t["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)

    edit_tensors(folder, out_of_range)
    refused(folder, "d2t[7]=493", "target id 500", "[0, 500)")
    edit_tensors(folder, lambda t: t["d2t"].__setitem__(3, -2**62))  # no int64 wrap-around
    refused(folder, "d2t[3]")


def test_d2t_mapping_two_rows_to_one_token_is_refused(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder
    tensors = load_file(str(folder / "model.safetensors"))
    ids = torch.arange(DRAFT_VOCAB) + tensors["d2t"]
    tensors["d2t"][5] = ids[4] - 5  # row 5 -> row 4's token
    save_file(tensors, str(folder / "model.safetensors"))
    refused(folder, "d2t maps two draft rows to target id", str(int(ids[4])))


def test_t2d_disagreeing_with_d2t_is_refused(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder
    tensors = load_file(str(folder / "model.safetensors"))
    unused = int((~tensors["t2d"]).nonzero()[0])
    tensors["t2d"][unused] = True
    save_file(tensors, str(folder / "model.safetensors"))
    refused(folder, "t2d marks target id", str(unused))
    tensors["t2d"][unused] = False
    used = int(tensors["t2d"].nonzero()[0])
    tensors["t2d"][used] = False
    save_file(tensors, str(folder / "model.safetensors"))
    refused(folder, "t2d leaves out target id", str(used))


def test_aux_layer_beyond_the_target_is_refused(tmp_path):
    folder = write_speculators(tmp_path / "spec", aux=[2, 3, 6]).folder
    refused(folder, "target layers [2, 3, 6]", "the target has 6")
    folder = write_specforge(tmp_path / "sf", aux_outputs=[0, 2, 5]).folder  # output of the last layer
    refused(folder, "target layers [1, 3, 6]")
    # A target too shallow for the default layers (2, 3, 3).
    refused(write_eagle(tmp_path / "eagle").folder, "names no aux layers", "[2, 3, 3]")


def test_draft_vocabulary_larger_than_the_vocabulary_is_refused(tmp_path):
    folder = write_eagle(tmp_path / "eagle").folder
    edit_config(folder, draft_vocab_size=VOCAB + 1)
    refused(folder, "config.json", "draft_vocab_size 501 exceeds the vocabulary (500)", target=DEEP)


def test_drafter_for_another_target_is_refused(tmp_path):
    folder = write_eagle(tmp_path / "eagle").folder
    edit_config(folder, vocab_size=600)
    refused(folder, "vocabulary has 600 tokens, the target's 500", target=DEEP)
    edit_config(folder, vocab_size=VOCAB, target_hidden_size=128)
    refused(folder, "hidden states of size 128", "target's are 64", target=DEEP)


def test_pickle_checkpoint_is_refused_unopened(tmp_path):
    folder = tmp_path / "eagle_bin"
    built = write_eagle(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    refused(built.folder, "pytorch_model.bin", "pickle", "never loaded", target=DEEP)


def test_config_that_is_not_an_object_is_refused(tmp_path):
    folder = write_eagle(tmp_path / "eagle").folder
    write_json(folder / "config.json", [1, 2, 3])
    refused(folder, "config.json", "JSON object", "list")
    (folder / "config.json").write_text("{not json", encoding="utf-8")
    refused(folder, "config.json", "not valid JSON")


@pytest.mark.parametrize(("change", "field"), [
    ({"architectures": ["LlamaForCausalLM"], "draft_vocab_size": None}, "not an EAGLE-3 drafter"),
    ({"num_hidden_layers": 2}, "num_hidden_layers=2"),
    ({"fc_norm": True}, "fc_norm"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "eagle_config.eagle_aux_hidden_state_layer_ids"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}},
     "they must agree"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"norm_before_residual": "yes"}, "norm_before_residual"),
])
def test_unsupported_or_malformed_config_fields_are_named(tmp_path, change, field):
    folder = write_specforge(tmp_path / "sf").folder
    edit_config(folder, **change)
    refused(folder, field)


def test_speculators_qwen3_layer_and_unknown_tensors_are_refused(tmp_path):
    folder = write_speculators(tmp_path / "spec").folder
    doc = json.loads((folder / "config.json").read_text())
    doc["transformer_layer_config"]["model_type"] = "qwen3"
    write_json(folder / "config.json", doc)
    refused(folder, "transformer_layer_config.model_type='qwen3'")
    doc["transformer_layer_config"]["model_type"] = "llama"
    write_json(folder / "config.json", doc)
    edit_tensors(folder, lambda t: t.update({"layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    refused(folder, "unexpected tensor 'layers.0.self_attn.q_norm.weight'")


def test_a_tensor_of_the_wrong_dtype_is_refused(tmp_path):
    folder = write_specforge(tmp_path / "sf").folder
    edit_tensors(folder, lambda t: t.update({"d2t": t["d2t"].float()}))
    refused(folder, "tensor d2t has dtype F32", "I64")
