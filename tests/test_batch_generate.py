"""train-draft's dense-batch generator (train/batch_generate.py): greedy answers are the
engine's, token for token, ending where the engine ends them; sampled rows follow their
settings and repeat with their seeds; settings it cannot honour are refused; a train-draft
run made with it trains and records which generator made its data."""

import dataclasses
import json

import pytest
import torch

from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.train import batch_generate
from specserve.train.batch_generate import BatchGenerator, choose_tokens
from specserve.train.config import TrainDraftConfig
from specserve.train.run import train_draft
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(make_tiny_checkpoint(tmp_path_factory.mktemp("bg") / "t", layers=2, seed=3))


PROMPTS = [[5, 9, 13], [7, 7, 21, 30, 2, 8, 11], list(range(2, 30)), [40]]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_answers_are_the_engines(tiny, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 7, 16)]
    engine = LLM(loaded=tiny, max_num_seqs=4).generate(PROMPTS, params, use_tqdm=False)
    # Small prefill passes too: the chunk's prompts split over several ragged passes.
    monkeypatch.setattr(batch_generate, "PREFILL_TOKENS", 10)
    ours = BatchGenerator(tiny).generate(PROMPTS, params)
    assert _ids(ours) == _ids(engine)
    assert [o.outputs[0].finish_reason for o in ours] == [o.outputs[0].finish_reason for o in engine]
    assert [o.outputs[0].text for o in ours] == [o.outputs[0].text for o in engine]


def test_a_stop_token_ends_the_row_as_the_engine_does(tiny):
    free = BatchGenerator(tiny).generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=12))
    stop = free[1].outputs[0].token_ids[4]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    ours = BatchGenerator(tiny).generate(PROMPTS[:2], params)
    engine = LLM(loaded=tiny, max_num_seqs=2).generate(PROMPTS[:2], params, use_tqdm=False)
    assert _ids(ours) == _ids(engine)
    assert ours[1].outputs[0].finish_reason == "stop" and ours[1].outputs[0].token_ids[-1] == stop


def test_sampled_rows_repeat_with_their_seeds_and_follow_top_p(tiny):
    gen = BatchGenerator(tiny)
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=s) for s in range(4)]
    a, b = gen.generate(PROMPTS, params), gen.generate(PROMPTS, params)
    assert _ids(a) == _ids(b)
    other = gen.generate(PROMPTS, [SamplingParams(temperature=1.0, max_tokens=16, seed=s + 10) for s in range(4)])
    assert _ids(other) != _ids(a)
    # top_p below any token's probability keeps the most likely token alone: the greedy answer.
    narrow = gen.generate(PROMPTS, [SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=16, seed=s) for s in range(4)])
    assert _ids(narrow) == _ids(gen.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16)))


def test_choose_tokens_draws_from_the_top_p_set_in_proportion():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20000, 4).contiguous()
    noise = torch.Generator().manual_seed(0)
    picks = choose_tokens(logits, torch.ones(20000), torch.full((20000,), 0.8), noise)
    freq = torch.bincount(picks, minlength=4).double() / 20000
    # {0, 1} reaches 0.8: renormalized 0.625 / 0.375, nothing else (4 sigma is ~0.014).
    assert freq[2] == freq[3] == 0
    assert abs(freq[0] - 0.625) < 0.014 and abs(freq[1] - 0.375) < 0.014
    greedy = choose_tokens(logits[:3], torch.zeros(3), torch.ones(3), noise)
    assert greedy.tolist() == [0, 0, 0]


@pytest.mark.parametrize("bad", [dict(top_k=5), dict(stop=["x"]), dict(repetition_penalty=1.2), dict(n=2)])
def test_settings_it_cannot_honour_are_refused(tiny, bad):
    with pytest.raises(ValueError, match="batch generator takes"):
        BatchGenerator(tiny).generate(PROMPTS[:1], SamplingParams(max_tokens=4, **bad))


def test_train_draft_with_the_batch_generator_and_budgets(tiny, tmp_path, capsys):
    """The whole eagle3 run with --generator batch (self-written user turns, sampled, then greedy
    answers), a data budget that stops after the first chunk and a training budget."""
    path = str(tiny.path)
    cfg = TrainDraftConfig(method="eagle3", target=path, out=str(tmp_path / "e3"), num_prompts=24, chunk_size=8,
                           max_new_tokens=12, prompt_max_tokens=12, held_out=0.25, tokens_per_batch=128,
                           eval_depth=2, depth=2, epochs=50, generator="batch", data_minutes=1e-6,
                           train_minutes=1e-4)
    _, report = train_draft(cfg, log=lambda m: None)
    cache = tmp_path / "e3" / "cache"
    assert json.loads((cache / "data.json").read_text())["generator"] == "batch"
    assert sorted(p.name for p in cache.glob("shard-*.safetensors")) == ["shard-00000.safetensors"]
    err = capsys.readouterr().out
    assert "data budget" in err and "1 of 3 shards" in err and "training budget" in err
    history = json.loads((tmp_path / "e3" / "config.json").read_text())["specserve"]["extra"]["training"]["history"]
    assert len(history) - 1 < 50 and report.top1_by_depth  # the budget cut the 50 epochs short
    # The cache refuses the other generator's run.
    with pytest.raises(InvalidParameterError, match="generator"):
        train_draft(dataclasses.replace(cfg, generator="engine", out=str(tmp_path / "e3b"), cache=str(cache)),
                    log=lambda m: None)


@pytest.mark.parametrize("bad", [dict(generator="gpu"), dict(data_minutes=0), dict(train_minutes=-1.0)])
def test_train_draft_refuses_bad_generators_and_budgets(bad):
    with pytest.raises(InvalidParameterError, match=next(iter(bad)).replace("_", "-")):
        TrainDraftConfig(method="eagle3", target="default", out="x", **bad)


def test_auto_generator_is_the_batch_off_the_cpu():
    cfg = TrainDraftConfig(method="eagle3", target="default", out="x")
    assert (cfg.generator_on("cpu"), cfg.generator_on("cuda")) == ("engine", "batch")
    assert dataclasses.replace(cfg, generator="engine").generator_on("cuda") == "engine"
