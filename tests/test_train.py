"""`specserve train-draft` on a tiny target: the trained heads beat untrained ones and chance on
held-back sequences, the folder loads as a drafter, an interrupted run resumes to exactly the
weights of an uninterrupted one, and the data cache resumes shard by shard.

The target is a tiny random Llama with its attention output zeroed: a bigram model, whose
greedy continuation is a function of the last token. A random target with attention is a
chaotic function of its whole context that no head learns from a thousand tokens, so the test
could not tell training from noise; here it learns within two epochs."""

import dataclasses
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.cli import main
from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.train.config import TrainDraftConfig
from specserve.model.loader import load_model
from specserve.train import trainer
from specserve.train.run import train_draft
from specserve.train.trainer import save_checkpoint
from tests.helpers import make_tiny_checkpoint

# One chunk of prompts (answered together), short answers, small batches: seconds, not minutes.
TINY = dict(num_prompts=40, max_new_tokens=32, chunk_size=20, held_out=0.25, tokens_per_batch=256,
            eval_depth=4, lr=1e-2)


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bigram") / "t", layers=1, seed=4)
    weights = load_file(str(path / "model.safetensors"))
    for name in weights:
        if name.endswith("o_proj.weight"):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return {"target": str(path), "loaded": load_model(path)}


def write_prompts(path, n=40, seed=0):
    """Short phrases repeated, as word-level prompts for the tiny tokenizer."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            phrase = [f"t{rng.randrange(2, 64)}" for _ in range(rng.randrange(2, 6))]
            f.write(json.dumps({"prompt": " ".join((phrase * 10)[: rng.randrange(4, 24)])}) + "\n")
    return path


@pytest.fixture(scope="module")
def eagle_runs(bigram, tmp_path_factory):
    """Run A: interrupted right after its epoch-1 checkpoint, then resumed. Run B: the same two
    epochs uninterrupted, on a copy of A's data cache."""
    root = tmp_path_factory.mktemp("train")
    prompts = write_prompts(root / "prompts.jsonl")
    cfg = dict(TINY, method="eagle", target=bigram["target"], prompts=str(prompts), seed=3, epochs=2)
    a, b = root / "a", root / "b"

    def save_then_interrupt(*args):
        save_checkpoint(*args)
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "save_checkpoint", save_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            train_draft(TrainDraftConfig(**cfg, out=str(a)), log=lambda m: None)
    assert json.loads((a / "checkpoint" / "state.json").read_text())["epochs_done"] == 1
    b.mkdir()
    shutil.copytree(a / "cache", b / "cache")
    shutil.copy(a / "run.json", b / "run.json")
    train_draft(TrainDraftConfig(**cfg, out=str(b), resume=True), log=lambda m: None)
    _, report = train_draft(TrainDraftConfig(**cfg, out=str(a), resume=True), log=lambda m: None)
    return {"a": a, "b": b, "report": report, "cfg": cfg}


def test_eagle_heads_beat_untrained_and_chance(eagle_runs):
    config = json.loads((eagle_runs["a"] / "config.json").read_text())
    history = config["training"]["history"]
    untrained, trained = history[0]["held_out"], eagle_runs["report"]
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert min(trained.top1_by_depth) > 0.5 > 10 * trained.chance_top1
    assert max(untrained["top1_by_depth"]) < 0.1
    assert trained.expected_accepted_length > 2.5 > 1.2 > untrained["expected_accepted_length"]
    assert trained.loss < untrained["loss"]
    assert config["training"]["seed"] == 3 and config["method"] == "eagle"
    assert config["target"]["vocab_size"] == 64


def test_resumed_training_equals_uninterrupted(eagle_runs):
    a = load_file(str(eagle_runs["a"] / "checkpoint" / "heads.safetensors"))
    b = load_file(str(eagle_runs["b"] / "checkpoint" / "heads.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (eagle_runs["a"] / "model.safetensors").read_bytes() == (eagle_runs["b"] / "model.safetensors").read_bytes()


def test_trained_eagle_folder_speculates_losslessly(bigram, eagle_runs):
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = [[5, 9, 13, 5, 9, 13, 5], [7, 7, 21, 30], list(range(2, 40))]
    plain = LLM(loaded=bigram["loaded"], max_num_seqs=1).generate(prompts, params, use_tqdm=False)
    llm = LLM(loaded=bigram["loaded"], max_num_seqs=3,
              speculative_config={"method": "eagle", "model": str(eagle_runs["a"]), "num_speculative_tokens": 3})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert LLM.aggregate_spec_stats(outs).mean_accepted_length > 2.0


def test_data_cache_resumes_shard_by_shard(eagle_runs, tmp_path):
    """A deleted (or never written) shard is the only one recomputed, to the same bytes."""
    cfg = dict(eagle_runs["cfg"], num_prompts=40, chunk_size=10, epochs=1)
    out = tmp_path / "c"
    train_draft(TrainDraftConfig(**cfg, out=str(out)), log=lambda m: None)
    shards = sorted((out / "cache").glob("shard-*.safetensors"))
    assert len(shards) == 4
    before = {p.name: p.read_bytes() for p in shards}
    mtimes = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[2].unlink()
    train_draft(TrainDraftConfig(**cfg, out=str(out), resume=True), log=lambda m: None)
    after = sorted((out / "cache").glob("shard-*.safetensors"))
    assert {p.name: p.read_bytes() for p in after} == before
    assert [p.name for p in after if p.stat().st_mtime_ns != mtimes[p.name]] == [shards[2].name]


def test_runs_with_the_same_data_settings_share_a_cache(eagle_runs, tmp_path):
    cache = eagle_runs["a"] / "cache"
    shards = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}
    cfg = dict(eagle_runs["cfg"], method="medusa", epochs=1, depth=None, lr=None, cache=str(cache))
    train_draft(TrainDraftConfig(**cfg, out=str(tmp_path / "m")), log=lambda m: None)
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")} == shards
    with pytest.raises(InvalidParameterError, match="max_new_tokens"):
        train_draft(TrainDraftConfig(**dict(cfg, max_new_tokens=16), out=str(tmp_path / "n")), log=lambda m: None)


def test_a_cache_grows_and_keeps_shards_whose_self_written_turns_were_dropped(bigram, tmp_path, monkeypatch):
    """A self-written turn that rambles is dropped, so a shard can hold fewer sequences than its
    chunk asked for: it is still complete. Asking for more prompts later answers only the new
    chunks (the prompt count is not part of the data's identity)."""
    from specserve.train import data as data_mod
    from specserve.train.data import DataPlan, build_data

    def fewer_turns(llm, seeds, max_tokens):  # one turn of every chunk dropped, as rambling ones are
        return [f"t{2 + s % 60} t{3 + s % 50}" for s in seeds[1:]]

    monkeypatch.setattr(data_mod, "write_user_turns", fewer_turns)
    answered = []
    real = data_mod._record_chunk
    monkeypatch.setattr(data_mod, "_record_chunk", lambda *a: answered.append(a[5].name) or real(*a))
    plan = DataPlan(None, 8, 4, 0, 8, 4, record=False)
    cache = tmp_path / "cache"
    build_data(bigram["loaded"], plan, None, cache)
    assert answered == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert len(load_file(str(cache / "shard-00000.safetensors"))["prompt_lens"]) == 3
    build_data(bigram["loaded"], dataclasses.replace(plan, num_prompts=12), None, cache)
    assert answered[2:] == ["shard-00002.safetensors"]


def test_medusa_heads_beat_untrained_and_chance(bigram, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", seed=1)
    out = tmp_path / "m"
    _, report = train_draft(TrainDraftConfig(**TINY, method="medusa", target=bigram["target"], prompts=str(prompts),
                                             out=str(out), epochs=2, tree_nodes=6), log=lambda m: None)
    config = json.loads((out / "config.json").read_text())
    untrained = config["training"]["history"][0]["held_out"]
    assert report.loss < untrained["loss"]
    assert min(report.top1_by_depth) > 0.3 > 10 * report.chance_top1
    assert report.top1_by_depth[0] > untrained["top1_by_depth"][0] + 0.2
    assert config["num_heads"] == 4 and 1 <= len(config["tree_choices"]) <= 6
    assert all(c[:-1] in config["tree_choices"] for c in config["tree_choices"] if len(c) > 1)


@pytest.fixture(scope="module")
def eagle3_run(bigram, tmp_path_factory):
    """One EAGLE-3 run on the bigram target: its folder, data cache, settings and final report."""
    root = tmp_path_factory.mktemp("eagle3")
    prompts = write_prompts(root / "p.jsonl", seed=2)
    cfg = dict(TINY, method="eagle3", target=bigram["target"], prompts=str(prompts), depth=3,
               cache=str(root / "cache"))
    out = root / "e3"
    _, report = train_draft(TrainDraftConfig(**cfg, out=str(out), epochs=3), log=lambda m: None)
    return {"out": out, "cfg": cfg, "report": report, "root": root}


def test_eagle3_learns_from_token_shards_and_speculates_losslessly(bigram, eagle3_run):
    """EAGLE-3 end to end: the data cache keeps token ids only, the target's captured states are
    recomputed beside it, training-time test learns the bigram target's choices at every
    unrolled depth, and the folder (SpecForge's layout) drafts losslessly."""
    out, report, cache = eagle3_run["out"], eagle3_run["report"], eagle3_run["root"] / "cache"
    shard = load_file(str(cache / "shard-00000.safetensors"))
    assert set(shard) == {"tokens", "offsets", "prompt_lens"}
    assert (cache / "features-00000.safetensors").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "d2t" in load_file(str(out / "model.safetensors"))
    untrained = config["specserve"]["extra"]["training"]["history"][0]["held_out"]
    assert report.loss < untrained["loss"]
    assert report.top1_by_depth[0] > max(0.5, untrained["top1_by_depth"][0] + 0.3) > 10 * report.chance_top1
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = [[5, 9, 13, 5, 9, 13, 5], [7, 7, 21, 30], list(range(2, 40))]
    plain = LLM(loaded=bigram["loaded"], max_num_seqs=1).generate(ids, params, use_tqdm=False)
    llm = LLM(loaded=bigram["loaded"], max_num_seqs=3,
              speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": 3})
    outs = llm.generate(ids, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert LLM.aggregate_spec_stats(outs).mean_accepted_length > 1.5


def test_eagle3_init_fine_tunes_a_drafter_from_where_it_stopped(eagle3_run):
    """--init starts from a drafter's weights and draft vocabulary: on the same data, the run's
    first held-out report is the saved drafter's own, and training goes on from there."""
    first, before = eagle3_run["out"], eagle3_run["report"]
    again = eagle3_run["root"] / "again"
    cfg = dict(eagle3_run["cfg"], lr=1e-3, draft_vocab=0)  # the vocabulary comes from --init, whatever is asked
    _, after = train_draft(TrainDraftConfig(**cfg, out=str(again), epochs=1, init=str(first)), log=lambda m: None)
    training = json.loads((again / "config.json").read_text())["specserve"]["extra"]["training"]
    assert training["history"][0]["held_out"] == before.as_dict()  # where the saved drafter stopped
    assert training["init"]["drafter"] == str(first) and training["init"]["epochs"] == 3
    weights = {name: load_file(str(folder / "model.safetensors")) for name, folder in (("a", first), ("b", again))}
    assert torch.equal(weights["a"]["d2t"], weights["b"]["d2t"])
    assert not torch.equal(weights["a"]["fc.weight"], weights["b"]["fc.weight"])  # it trained
    assert after.loss < 1.5 * before.loss and after.top1_by_depth[0] > 0.5  # and kept what it knew
    with pytest.raises(InvalidParameterError, match="init"):
        TrainDraftConfig(method="eagle", target="default", out="x", init=str(first))
    # A folder that is no drafter is refused before any data is made.
    fresh = dict(cfg, cache=str(eagle3_run["root"] / "unmade"))
    with pytest.raises(ModelLoadError, match="has no config.json; an EAGLE-3 drafter folder needs one"):
        train_draft(TrainDraftConfig(**fresh, out=str(eagle3_run["root"] / "none"), init=str(again / "checkpoint")),
                    log=lambda m: None)
    assert not (eagle3_run["root"] / "unmade").exists()


def test_train_draft_command_refuses_bad_runs(bigram, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=4)
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("something")
    args = ["train-draft", "--method", "eagle", "--target", bigram["target"], "--prompts", str(prompts)]
    assert main(args + ["--out", str(used)]) == 2  # not empty, no --resume
    assert main(args + ["--out", str(tmp_path / "n"), "--epochs", "0"]) == 2
    with pytest.raises(SystemExit):
        main(args[:2] + ["lookahead", "--out", str(tmp_path / "m")])
    with pytest.raises(InvalidParameterError, match="draft-vocab"):
        TrainDraftConfig(method="eagle", target="default", out="x", draft_vocab=-1)


def test_resume_with_other_settings_is_refused(eagle_runs):
    cfg = dict(eagle_runs["cfg"], seed=4)
    with pytest.raises(InvalidParameterError, match="seed"):
        train_draft(TrainDraftConfig(**cfg, out=str(eagle_runs["a"]), resume=True), log=lambda m: None)


def test_captured_final_states_are_what_the_target_head_reads(bigram):
    """capture_states(final=True): the same pass's final hidden states, which the target's head
    turns into exactly its logits, and the three layers' states as without them; TargetHead
    (what --targets probs trains toward) is that head at the draft ids."""
    from specserve.model.runner import ForwardBatch, ModelRunner
    from specserve.train.eagle3 import TargetHead
    from specserve.train.features import capture_states

    target = bigram["loaded"]
    seqs = [[5, 9, 13, 5, 9], [7, 21, 30, 2, 8, 40, 11]]
    states, finals = capture_states(target, seqs, (0, 0, 0), final=True)
    alone, none = capture_states(target, seqs, (0, 0, 0))
    assert none is None and all(torch.equal(a, b) for a, b in zip(states, alone))
    ids = torch.tensor([3, 17, 5, 40, 9])
    head = TargetHead(target, ids)
    for seq, final in zip(seqs, finals):
        runner = ModelRunner.dense(target.model, 1, len(seq))
        out = runner.forward(ForwardBatch([0], [0], [seq], all_logits=True, keep_hidden=True))
        assert torch.equal(final, out.hidden[0].half())  # stored as float16
        torch.testing.assert_close(head(out.hidden[0].float()), out.logits[0][:, ids])


def test_soft_targets_that_are_one_hot_give_the_labels_cross_entropy(bigram):
    """The probabilities' cross-entropy is the labels' when the target puts all its mass on
    its argmax: the two objectives differ only by what else the target weighs."""
    from specserve.train.objectives import _step

    class Vocab:
        def vocab(self, rows):
            return rows @ torch.arange(24.0).reshape(4, 6).sin()

    hidden = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 5, -1, 0, 2], [3, 3, 4, -1, 1]])
    valid = torch.tensor([[True, True, True, False, True], [False, True, True, True, True]])
    probs = torch.nn.functional.one_hot(labels.clamp(min=0), 6).float()
    hard = _step(Vocab(), hidden, None, labels, valid, True, 0.8)
    soft = _step(Vocab(), hidden, None, labels, valid, True, 0.8, probs)
    torch.testing.assert_close(soft.loss, hard.loss)
    assert torch.equal(soft.correct, hard.correct) and torch.equal(soft.ranks, hard.ranks)


def test_eagle3_learns_toward_the_target_probabilities(bigram, eagle3_run):
    """--targets probs: the states file gains the final hidden states (recomputed once; a later
    argmax run reads the same file), the run learns the target's choices, and it records the
    setting; a run recorded before the setting existed resumes as argmax."""
    cfg = dict(eagle3_run["cfg"], targets="probs")
    features = eagle3_run["root"] / "cache" / "features-00000.safetensors"
    assert "final" not in load_file(str(features))
    out = eagle3_run["root"] / "probs"
    _, report = train_draft(TrainDraftConfig(**cfg, out=str(out), epochs=3), log=lambda m: None)
    assert "final" in load_file(str(features))
    stamp = features.stat().st_mtime_ns
    training = json.loads((out / "config.json").read_text())["specserve"]["extra"]["training"]
    assert training["settings"]["targets"] == "probs"
    untrained = training["history"][0]["held_out"]
    assert report.top1_by_depth[0] > max(0.5, untrained["top1_by_depth"][0] + 0.3) > 10 * report.chance_top1
    # The first run's folder, its run.json as written before --targets: resumes as argmax.
    run = eagle3_run["out"] / "run.json"
    recorded = json.loads(run.read_text())
    recorded.pop("targets")
    run.write_text(json.dumps(recorded))
    train_draft(TrainDraftConfig(**eagle3_run["cfg"], out=str(eagle3_run["out"]), epochs=3, resume=True),
                log=lambda m: None)
    assert features.stat().st_mtime_ns == stamp
    with pytest.raises(InvalidParameterError, match="targets"):
        train_draft(TrainDraftConfig(**cfg, out=str(eagle3_run["out"]), epochs=3, resume=True), log=lambda m: None)
    with pytest.raises(InvalidParameterError, match="probs is for --method eagle3"):
        TrainDraftConfig(method="eagle", target="default", out="x", targets="probs")
