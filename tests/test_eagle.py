"""EAGLE speculation end to end (float32, greedy): the output equals plain greedy decoding,
single and batched on the paged engine, with a near-perfect drafter (many accepted drafts), an
untrained one (every draft rejected) and the embedded model; plus the drafter's files."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.spec.heads import load_drafter, new_drafter, save_drafter
from tests.helpers import make_tiny_checkpoint, ragged_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def outputs(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], LLM.aggregate_spec_stats(outs)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """A one-layer tiny target and an EAGLE drafter that computes what the target computes:
    fc passes the token's embedding through, and the decoder layer is the target's own. Its
    feature at t+1 then differs from the target's only by the final norm (weight 1 here, a
    positive scale that keeps the argmax) and by never seeing the first token, so it drafts
    the target's greedy tokens almost always."""
    root = tmp_path_factory.mktemp("eagle")
    path = make_tiny_checkpoint(root / "t", layers=1, seed=3)
    target = load_model(path)
    drafter = new_drafter(target, "eagle", torch.arange(target.config.vocab_size))
    w, p, h = load_file(str(path / "model.safetensors")), "model.layers.0.", target.config.hidden_size
    drafter.heads.load_state_dict({
        "fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
        "fc.bias": torch.zeros(h),
        "layer.input_layernorm.weight": w[p + "input_layernorm.weight"],
        "layer.post_attention_layernorm.weight": w[p + "post_attention_layernorm.weight"],
        "layer.self_attn.qkv_proj.weight": torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
        "layer.self_attn.o_proj.weight": w[p + "self_attn.o_proj.weight"],
        "layer.mlp.gate_up_proj.weight": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
        "layer.mlp.down_proj.weight": w[p + "mlp.down_proj.weight"],
    })
    save_drafter(root / "d", drafter)
    return {"loaded": target, "drafter": str(root / "d")}


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("depth,nodes,topk", [(4, 12, 3), (5, 5, 1), (6, 32, 6)])
def test_greedy_eagle_equals_plain(one_layer, max_num_seqs, depth, nodes, topk):
    prompts = ragged_prompts(6, seed=1)
    plain, _ = outputs(LLM(loaded=one_layer["loaded"], max_num_seqs=1), prompts)
    spec = {"method": "eagle", "model": one_layer["drafter"], "num_speculative_tokens": depth,
            "num_draft_nodes": nodes, "draft_topk": topk}
    got, stats = outputs(LLM(loaded=one_layer["loaded"], max_num_seqs=max_num_seqs, speculative_config=spec), prompts)
    assert got == plain
    assert stats.acceptance_by_position[0] > 0.9
    assert stats.mean_accepted_length > 0.6 * (depth + 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_untrained_eagle_is_lossless_on_a_two_layer_target(tiny, tmp_path, dtype):
    """Drafting in bfloat16 (the saved dtype) next to a float32 target changes candidates only."""
    torch.manual_seed(0)
    save_drafter(tmp_path / "d", new_drafter(tiny["loaded"], "eagle", torch.arange(2, 50), dtype=dtype))
    prompts = ragged_prompts(5, seed=2)
    plain, _ = outputs(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts)
    for seqs in (1, 5):
        got, stats = outputs(LLM(loaded=tiny["loaded"], max_num_seqs=seqs, speculative_config={
            "method": "eagle", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}), prompts)
        assert got == plain and stats.num_drafted > 0


def test_prefix_cache_hit_drafts_from_the_features_it_has(one_layer):
    """The second request's shared prefix comes from the prefix cache, so its first features
    start after position 0: the drafter's cache starts there too."""
    shared = ragged_prompts(1, seed=5, lo=40, hi=41)[0]
    prompts = [shared + [7, 8], shared + [9]]
    plain, _ = outputs(LLM(loaded=one_layer["loaded"], max_num_seqs=1), prompts)
    llm = LLM(loaded=one_layer["loaded"], max_num_seqs=1,
              speculative_config={"method": "eagle", "model": one_layer["drafter"], "num_speculative_tokens": 4})
    got, stats = outputs(llm, prompts)
    assert got == plain
    assert llm.engine.scheduler.kv.pool.prefix_cache_stats().hit_blocks > 0
    assert stats.mean_accepted_length > 2


def test_seeded_sampling_with_eagle_is_reproducible(one_layer):
    spec = {"method": "eagle", "model": one_layer["drafter"], "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=7)
    prompts = ragged_prompts(3, seed=4)
    a, _ = outputs(LLM(loaded=one_layer["loaded"], speculative_config=spec, max_num_seqs=3), prompts, params)
    b, _ = outputs(LLM(loaded=one_layer["loaded"], speculative_config=spec, max_num_seqs=1), prompts, params)
    assert a == b


def test_drafter_files_round_trip(tiny, tmp_path):
    torch.manual_seed(1)
    drafter = new_drafter(tiny["loaded"], "eagle", torch.tensor([5, 3, 9, 1]))
    save_drafter(tmp_path / "f32", drafter)
    loaded = load_drafter(tmp_path / "f32", tiny["loaded"], for_inference=False)
    assert loaded.vocab.ids.tolist() == [5, 3, 9, 1]
    for (k, a), b in zip(drafter.heads.state_dict().items(), loaded.heads.state_dict().values()):
        assert torch.equal(a, b), k
    torch.testing.assert_close(loaded.vocab.proj.weight, drafter.vocab.proj.weight, rtol=0, atol=0)
    drafter.config = type(drafter.config)(**{**{f: getattr(drafter.config, f) for f in drafter.config.__slots__},
                                             "dtype": "bfloat16"})
    save_drafter(tmp_path / "bf16", drafter)
    half = load_drafter(tmp_path / "bf16", tiny["loaded"], for_inference=False)
    for (k, a), b in zip(drafter.heads.state_dict().items(), half.heads.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), k


def test_drafter_for_another_target_or_no_folder_is_refused(tiny, one_layer, tmp_path):
    with pytest.raises(InvalidParameterError, match="trained for"):
        LLM(loaded=tiny["loaded"], speculative_config={"method": "eagle", "model": one_layer["drafter"]})
    other = load_model(make_tiny_checkpoint(tmp_path / "o", seed=9))  # the same shapes, other weights
    save_drafter(tmp_path / "d", new_drafter(tiny["loaded"], "eagle", torch.arange(64)))
    with pytest.raises(InvalidParameterError, match="embedding differs"):
        LLM(loaded=other, speculative_config={"method": "eagle", "model": str(tmp_path / "d")})
    with pytest.raises(InvalidParameterError, match="train-draft"):
        LLM(loaded=tiny["loaded"], speculative_config={"method": "eagle", "model": str(tmp_path / "none")})
    with pytest.raises(InvalidParameterError, match="needs the folder"):
        LLM(loaded=tiny["loaded"], speculative_config={"method": "eagle"})


@pytest.mark.parametrize("key, value", [("hidden_size", 2**20), ("num_heads", 0), ("intermediate_size", 64.5),
                                        ("rms_norm_eps", float("nan")), ("rope_theta", -1.0)])
def test_crafted_drafter_layer_is_refused_before_allocating(tiny, tmp_path, key, value):
    """A drafter's config.json is untrusted: its layer must have the target's shape, and its RoPE
    tables follow the target's positions (not the layer's claimed context)."""
    save_drafter(tmp_path / "d", new_drafter(tiny["loaded"], "eagle", torch.arange(64)))
    path = tmp_path / "d" / "config.json"
    raw = json.loads(path.read_text())
    raw["layer"][key] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=f"layer {key}="):
        load_drafter(tmp_path / "d", tiny["loaded"], for_inference=False)


def test_drafter_tables_follow_the_target_not_the_layer_context(tiny, tmp_path):
    save_drafter(tmp_path / "d", new_drafter(tiny["loaded"], "eagle", torch.arange(64)))
    path = tmp_path / "d" / "config.json"
    raw = json.loads(path.read_text())
    raw["layer"]["max_position_embeddings"] = 2**30
    path.write_text(json.dumps(raw))
    drafter = load_drafter(tmp_path / "d", tiny["loaded"], for_inference=False)
    assert drafter.heads.rotary.cos.shape[0] == tiny["loaded"].model.max_positions


def test_command_lines_name_the_drafter_and_its_tree():
    from specserve.bench.cli import parse_methods, speculative_configs
    from specserve.cli import build_parser
    from specserve.engine_args import speculative_config

    args = build_parser().parse_args(["generate", "hi", "--speculative", "eagle", "--draft-model", "d",
                                      "--num-speculative-tokens", "5", "--num-draft-nodes", "10", "--draft-topk", "3"])
    assert speculative_config(args, {}) == {"method": "eagle", "num_speculative_tokens": 5, "model": "d",
                                            "num_draft_nodes": 10, "draft_topk": 3}
    args = build_parser().parse_args(["generate", "hi", "--speculative", "medusa", "--draft-model", "m"])
    assert speculative_config(args, {}) == {"method": "medusa", "num_speculative_tokens": "auto", "model": "m"}
    configs = speculative_configs(parse_methods("none,ngram,eagle:.,medusa:."), [3], {"num_draft_nodes": 8})
    assert [(c.method, s.get("num_draft_nodes")) for c, s in configs] == [("ngram", None), ("eagle", 8), ("medusa", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_smollm_untrained_eagle_greedy_equals_plain(smollm_native, tmp_path, max_num_seqs):
    torch.manual_seed(0)
    save_drafter(tmp_path / "d", new_drafter(smollm_native, "eagle", torch.arange(4096)))
    msgs = [[{"role": "user", "content": p}] for p in
            ("Name three rivers.", "Repeat: red, green, blue, red, green, blue.")]
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=smollm_native, max_num_seqs=1).chat(msgs, params, use_tqdm=False)]
    llm = LLM(loaded=smollm_native, max_num_seqs=max_num_seqs,
              speculative_config={"method": "eagle", "model": str(tmp_path / "d"), "num_speculative_tokens": 4})
    outs = llm.chat(msgs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert LLM.aggregate_spec_stats(outs).num_drafted > 0


@pytest.mark.slow
def test_shipped_drafter_speculates_losslessly_on_smollm(smollm_native):
    """The committed drafter (model "default"), batched, on prompts of no training set. A fixed
    depth: the figure checked is the drafter's acceptance, which adaptive depths (auto) would
    mix with whether drafting pays on this machine's path (on the generic level it may not)."""
    msgs = [[{"role": "user", "content": p}] for p in ("Why do cats purr?", "List the planets of the solar system.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=smollm_native, max_num_seqs=1).chat(msgs, params, use_tqdm=False)]
    llm = LLM(loaded=smollm_native, max_num_seqs=2,
              speculative_config={"method": "eagle", "model": "default", "num_speculative_tokens": 4})
    outs = llm.chat(msgs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert LLM.aggregate_spec_stats(outs).mean_accepted_length > 1.2
