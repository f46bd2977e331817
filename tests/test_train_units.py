"""Pieces of train-draft on hand-built inputs: the unrolled attention against explicit
per-query attention, accepted lengths, the split, batches, draft vocabulary, Medusa's tree
choice, and the prompt sources (never Spec-Bench)."""

import json

import pytest
import torch

from specserve.bench.workload import spec_bench_path
from specserve.errors import InvalidParameterError
from specserve.model.attention import attention
from specserve.train.batches import answer_mask, choose_draft_vocab, make_batches, split, vocab_coverage, vocab_index
from specserve.train.data import Recorded
from specserve.train.evaluate import choose_tree
from specserve.train.objectives import StepResult, UnrolledAttention, accepted_lengths
from specserve.train.prompts import read_prompt_file, user_turn_prefix


def test_unrolled_attention_sees_context_causally_and_earlier_steps_at_its_index():
    g = torch.Generator().manual_seed(0)
    b, t, h, hkv, d, steps = 2, 5, 4, 2, 8, 3
    qs = [torch.randn(b, t, h, d, generator=g) for _ in range(steps)]
    ks = [torch.randn(b, t, hkv, d, generator=g) for _ in range(steps)]
    vs = [torch.randn(b, t, hkv, d, generator=g) for _ in range(steps)]
    cache = UnrolledAttention()
    outs = [cache.attend(0, q, k, v, None) for q, k, v in zip(qs, ks, vs)]
    for s in range(steps):
        for i in range(t):
            # query i of step s: step 1's keys 0..i, then step 2..s's key i
            keys = torch.cat([ks[0][:, : i + 1]] + [ks[r][:, i:i + 1] for r in range(1, s + 1)], dim=1)
            values = torch.cat([vs[0][:, : i + 1]] + [vs[r][:, i:i + 1] for r in range(1, s + 1)], dim=1)
            ref = attention(qs[s][:, i:i + 1], keys.transpose(1, 2), values.transpose(1, 2), None)
            torch.testing.assert_close(outs[s][:, i:i + 1], ref)


def _step(correct, valid):
    c, v = torch.tensor(correct), torch.tensor(valid)
    return StepResult(torch.tensor(0.0), c & v, v, torch.zeros(0, dtype=torch.long))


def test_accepted_lengths_count_leading_correct_depths():
    steps = [_step([[1, 1, 0, 1]], [[1, 1, 1, 0]]), _step([[1, 0, 1, 1]], [[1, 1, 1, 1]]),
             _step([[1, 1, 1, 1]], [[1, 1, 1, 1]])]
    accepted, starts = accepted_lengths([_step(s.correct.bool().tolist(), s.valid.bool().tolist()) for s in steps])
    assert starts.tolist() == [[True, True, True, False]]
    assert accepted.tolist() == [3, 1, 0]


def _recorded(lengths, prompt_lens, labels):
    return Recorded([torch.arange(n) for n in lengths], [torch.zeros(n, 4, dtype=torch.float16) for n in lengths],
                    [torch.tensor(lab) for lab in labels], prompt_lens)


def test_split_batches_and_masks():
    train, held = split(20, 0.25, seed=1)
    assert len(held) == 5 and sorted(train + held) == list(range(20)) and not set(train) & set(held)
    assert split(20, 0.25, seed=1) == (train, held)
    assert answer_mask(6, 3).tolist() == [False, False, True, True, True, False]
    data = _recorded([10 + i for i in range(20)], [2] * 20, [[0] * (10 + i) for i in range(20)])
    batches = make_batches(data, train, tokens_per_batch=40, seed=0)
    assert sorted(i for batch in batches for i in batch) == train
    assert all(len(b) == 1 or len(b) * max(10 + i for i in b) <= 40 for b in batches)
    assert make_batches(data, train, 40, seed=0) == batches != make_batches(data, train, 40, seed=1)


def test_draft_vocab_is_the_most_chosen_answer_tokens_plus_end_of_turn():
    # prompt_len 2: labels at positions 1.. len-2 count
    data = _recorded([6, 6], [2, 2], [[9, 5, 5, 5, 7, 8], [9, 7, 5, 3, 3, 8]])
    ids = choose_draft_vocab(data, [0, 1], size=3, vocab_size=10, always=frozenset({1}))
    assert ids.tolist() == [1, 5, 3] or ids.tolist() == [1, 5, 7]
    assert ids[:2].tolist() == [1, 5]
    assert vocab_coverage(data, [0, 1], torch.tensor([5, 3, 7]), 10) == 1.0
    assert vocab_index(torch.tensor([5, 3]), 7).tolist() == [-1, -1, -1, 1, -1, 0, -1]
    assert choose_draft_vocab(data, [0], size=50, vocab_size=10, always=frozenset()).tolist() == list(range(10))


def test_medusa_tree_is_best_first_and_prefix_closed():
    ranks = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.4, 0.1, 0.1]]
    choices, estimate = choose_tree(ranks, 5)
    assert choices == [[0], [0, 0], [1], [0, 1], [0, 0, 0]]
    assert estimate == pytest.approx(1 + 0.6 + 0.3 + 0.18 + 0.2 + 0.12)
    assert [1, 2] not in choose_tree(ranks, 100)[0]  # rank 2 at depth 2 was never right


def test_prompt_file_refuses_spec_bench_and_drops_its_prompts(tmp_path):
    with pytest.raises(InvalidParameterError, match="Spec-Bench"):
        read_prompt_file(spec_bench_path())
    first = json.loads(spec_bench_path().read_text().splitlines()[0])["turns"][0]
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": first}, {"prompt": "Tell me about owls."},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs = read_prompt_file(path)
    assert convs == [[{"role": "user", "content": "Tell me about owls."}], rows[2]["messages"]]
    # The benchmarks' rule: a prompt under turns (the first), prompt or text.
    path.write_text('{"turns": ["First turn.", "Second."]}\n{"text": "Some text."}\n')
    assert read_prompt_file(path) == [[{"role": "user", "content": "First turn."}],
                                      [{"role": "user", "content": "Some text."}]]
    path.write_text('{"question": "no prompt key"}\n')
    with pytest.raises(InvalidParameterError, match='line 1 has no "messages" list and no prompt under'):
        read_prompt_file(path)


def test_user_turn_prefix_ends_where_the_user_speaks(smollm_native):
    tok = smollm_native.tokenizer
    prefix = tok.decode(user_turn_prefix(tok), skip_special_tokens=False)
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix
