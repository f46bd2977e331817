"""Drafting across tokenizers (spec/cross_vocab.py): a draft model whose token ids name other
tokens than the target's drafts through text. Greedy output equals plain greedy token for token;
sampled output has the target's exact distribution; a draft that is the target under another
numbering is accepted every time (the text round trip loses nothing)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import LLM, SamplingParams
from specserve.model.loader import load_model
from specserve.spec.cross_vocab import CrossVocabularyProposer
from specserve.spec.draft_model import DraftModelProposer
from tests.helpers import make_tiny_checkpoint
from tests.test_spec_e2e import LENGTH, V, sample_first_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def renumbered(src: Path, dst: Path, extra: int = 0, seed: int = 0) -> Path:
    """A copy of the word-level model folder `src` whose token ids are shuffled (but for <s>
    and </s>), plus `extra` words the target does not know, with random rows: the same model
    under another tokenizer."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    n = cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    order = [0, 1] + (torch.randperm(n - 2 + extra, generator=g) + 2).tolist()  # new id of old id / extra word
    words = ["<s>", "</s>"] + [f"t{i}" for i in range(2, n)] + [f"x{j}" for j in range(extra)]
    vocab = {w: order[i] for i, w in enumerate(words)}
    weights = load_file(str(dst / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        old = weights[name]
        new = torch.randn(n + extra, old.shape[1], generator=g) * old.std()
        new[torch.tensor(order[:n])] = old
        weights[name] = new.contiguous()
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["vocab_size"] = n + extra
    (dst / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((dst / "tokenizer.json").read_text())
    tok["model"]["vocab"] = vocab
    for added in tok["added_tokens"]:
        added["id"] = vocab[added["content"]]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("xvocab")
    target = make_tiny_checkpoint(root / "target", vocab_size=64, seed=0)
    # The target itself, renumbered: no extra words, whose random head rows could win its argmax
    # and draft what the target never would. (`other` has extra words.)
    same = renumbered(target, root / "same")
    other = renumbered(make_tiny_checkpoint(root / "small", vocab_size=64, seed=1, layers=1, hidden=32, heads=2,
                                            kv_heads=1), root / "other", extra=8, seed=1)
    return load_model(target), same, other


def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]


def test_a_draft_of_another_tokenizer_drafts_through_text(models):
    target, same, _ = models
    llm = LLM(loaded=target, max_num_seqs=4,
              speculative_config={"method": "draft_model", "model": str(same), "num_speculative_tokens": 4})
    proposer = llm.engine.proposer
    assert isinstance(proposer, CrossVocabularyProposer)
    # The text round trip: target ids -> the draft's ids of the same words -> target ids.
    ids = [5, 9, 33, 2]
    draft_ids = proposer.draft_ids(ids)
    assert draft_ids != ids and proposer.draft_tok.decode(draft_ids) == target.tokenizer.decode(ids)
    assert proposer.target_continuation(ids, " t7 t8", 4) == [7, 8]
    assert proposer.target_continuation(ids, " t7 t8", 1) == [7]
    assert proposer.target_continuation(ids, " x3", 4) == [1]  # a word the target lacks is its unknown token


def test_greedy_output_is_plain_greedy_and_a_renumbered_target_is_always_accepted(models):
    target, same, other = models
    plain = [o.outputs[0].token_ids for o in LLM(loaded=target, max_num_seqs=4).generate(prompts(), GREEDY,
                                                                                         use_tqdm=False)]
    for draft, k in ((same, 4), (other, 3)):
        llm = LLM(loaded=target, max_num_seqs=4,
                  speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": k})
        outs = llm.generate(prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
        stats = LLM.aggregate_spec_stats(outs)
        if draft is same:  # the same model under another numbering: every draft is the target's
            assert stats.acceptance_rate == 1.0 and stats.num_drafted > 0
        else:
            assert stats.num_drafted > 0


def test_same_vocabulary_drafts_stay_on_token_ids(models, tmp_path):
    target, _, _ = models
    twin = make_tiny_checkpoint(tmp_path / "twin", vocab_size=64, seed=1, layers=1, hidden=32, heads=2, kv_heads=1)
    llm = LLM(loaded=target, speculative_config={"method": "draft_model", "model": str(twin)})
    assert type(llm.engine.proposer) is DraftModelProposer


@pytest.fixture(scope="module")
def micro_cross(tmp_path_factory):
    """The exact-distribution fixture of test_spec_e2e (a vocabulary of 8, enumerable) with a
    draft of another tokenizer: the target renumbered and given 4 more words."""
    root = tmp_path_factory.mktemp("micro_x")
    target = make_tiny_checkpoint(root / "t", vocab_size=V, hidden=32, heads=2, kv_heads=1, seed=5)
    draft = make_tiny_checkpoint(root / "d", vocab_size=V, hidden=32, heads=2, kv_heads=1, seed=6, layers=1)
    return load_model(target), renumbered(draft, root / "dx", extra=4, seed=2)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_output_across_tokenizers_has_the_target_distribution(micro_cross, temperature):
    loaded, draft = micro_cross
    llm = LLM(loaded=loaded, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    assert isinstance(llm.engine.proposer, CrossVocabularyProposer)
    params = SamplingParams(temperature=temperature, max_tokens=LENGTH, ignore_eos=True)
    outs, pvalue = sample_first_tokens(llm, [3, 5, 2], replace(params))
    assert 0.05 < LLM.aggregate_spec_stats(outs).acceptance_rate < 0.95  # drafts accepted and rejected
    assert pvalue > 1e-3
