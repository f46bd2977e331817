"""EAGLE-3 drafting: the proposer's paged, batched tree growth against a dense recomputation of
every path, and speculation end to end (greedy output equals plain greedy decoding)."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import native
from specserve.config import EngineConfig
from specserve.drafts import SpecRequest
from specserve.llm import LLM
from specserve.model.attention import attention
from specserve.sampling_params import SamplingParams
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import Eagle3Config
from specserve.spec.heads.eagle3_loader import DRAFTER_FORMATS, Eagle3Drafter
from specserve.spec.hybrid import SuffixFirst
from specserve.spec.suffix import SuffixProposer
from tests.helpers import ragged_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=40)


def random_head(target, aux=(0, 1, 1), vocab=None, seed=0, scale=3.0) -> Eagle3Head:
    tc = target.config
    vd = len(vocab) if vocab is not None else tc.vocab_size
    cfg = Eagle3Config(hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size, num_heads=tc.num_heads,
                       num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, intermediate_size=tc.intermediate_size,
                       rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=None,
                       max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
                       draft_vocab_size=vd, aux_layers=aux)
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, target.model.max_positions)
    with torch.no_grad():
        for p in head.parameters():  # peaked, varied logits: no near-ties among candidates
            if p.dim() > 1:
                p.normal_(0, scale / p.shape[-1] ** 0.5)
        if vocab is not None:
            head.draft_ids.copy_(torch.as_tensor(vocab))
    return head.eval()


class _Causal:
    """Dense causal attention over one sequence: q, k, v [1, T, heads, D]."""

    def attend(self, layer, q, k, v, meta):
        t = q.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)
        return attention(q, k.transpose(1, 2), v.transpose(1, 2), mask[None, None])


def path_logits(head: Eagle3Head, embed, states: torch.Tensor, tokens: list[int], first: int,
                path: list[int]) -> torch.Tensor:
    """The drafter's logits after `path` (target ids), recomputed densely from scratch: context
    rows first..L (state at p, token at p + 1), then one row per path token, each row's feature
    the previous row's output, all causal. -> [Vd] at the last row."""
    ctx = states[first:]  # [C, 3 Ht]
    rows_tokens = tokens[first + 1:] + path
    n_ctx = len(ctx)
    with torch.no_grad():
        feats = head.fuse(ctx.float())
        out = None
        # The context in one causal pass, then each path row appended (its feature is known only
        # after the row before it ran), all re-run densely.
        seq_feats = [feats[i] for i in range(n_ctx)]
        for j in range(len(path) + 1):
            f = torch.stack(seq_feats)[None]  # [1, T, H]
            e = embed(torch.tensor(rows_tokens[:n_ctx + j]))[None].float()
            pos = torch.arange(first, first + n_ctx + j)[None]
            out = head(e, f, pos, None, _Causal())[0]  # [T, H]
            seq_feats.append(out[-1])
    return head.logits(out[-1])


def reference_tree(head, embed, states, tokens, first, depth, topk, max_nodes):
    """EAGLE-2's tree by brute force over dense recomputations -> [(path tuple)] chosen."""
    ids = head.draft_ids
    cands = []  # (score, depth, order, path)
    frontier = [((), 0.0)]
    order = 0
    for level in range(1, depth + 1):
        children = []
        for path, score in frontier:
            lp = torch.log_softmax(path_logits(head, embed, states, tokens, first, list(path)), -1).double()
            top = lp.topk(topk)
            for v, i in zip(top.values.tolist(), top.indices.tolist()):
                children.append((path + (int(ids[i]),), score + v))
        for path, score in children:
            cands.append((score - 1e-6 * level, order, path))
            order += 1
        frontier = sorted(children, key=lambda c: -c[1])[:topk]
    chosen = sorted(cands, key=lambda c: -c[0])[:max_nodes]
    return sorted(c[2] for c in chosen)


def tree_paths(tree) -> list[tuple]:
    paths = []
    for i in range(tree.num_nodes):
        p, j = [], i
        while j >= 0:
            p.append(tree.token_ids[j])
            j = tree.parents[j]
        paths.append(tuple(reversed(p)))
    return sorted(paths)


@pytest.mark.parametrize("first", [0, 5])
def test_batched_paged_tree_growth_equals_a_dense_recomputation(tiny, first):
    """Two requests of different lengths drafting together (one starting its drafter entries
    late, as after a prefix-cache hit), a catch-up of the whole prompt and then of an accepted
    path: every tree equals the one grown by recomputing each path densely."""
    target = tiny["loaded"]
    head = random_head(target, vocab=list(range(3, 60)))
    drafter = Eagle3Drafter(head.config, head, target.model.embed_tokens, None)
    engine = EngineConfig(max_num_seqs=2, max_model_len=256, num_kv_blocks=64, block_size=4)
    prop = Eagle3Proposer(drafter, target, engine, max_nodes=7, topk=3)
    prop.kv.cache.k.fill_(math.nan)  # a slot read before it is written poisons the drafts
    prop.kv.cache.v.fill_(math.nan)
    h3 = 3 * target.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randint(2, 64, (23,), generator=gen).tolist(), "b": torch.randint(2, 64, (14,), generator=gen).tolist()}
    states = {r: torch.randn(len(s) + 6, h3, generator=gen) for r, s in seqs.items()}
    starts = {"a": first, "b": 0}
    for rid, s in seqs.items():  # the prompt's states (the last token is the root)
        prop.observe_hidden(rid, starts[rid], states[rid][starts[rid]:len(s) - 1])
    for step in range(2):
        batch = [SpecRequest(rid, s, 4, GREEDY, None, max_nodes=7) for rid, s in seqs.items()]
        trees = prop.propose(batch).trees
        for (rid, s), tree in zip(seqs.items(), trees):
            want = reference_tree(head, target.model.embed_tokens, states[rid][:len(s) - 1], s, starts[rid], 4, 3, 7)
            assert tree_paths(tree) == want, (rid, step)
        # Commit three tokens each (an accepted path of two drafts and a bonus) and their states.
        for rid, s in seqs.items():
            n = len(s)
            seqs[rid] = s + torch.randint(2, 64, (3,), generator=gen).tolist()
            prop.observe_hidden(rid, n - 1, states[rid][n - 1:n + 2])


def test_suffix_decoding_beside_the_drafter_takes_the_confident_suffix_drafts(tiny):
    """enable_suffix_decoding: a request whose text repeats takes suffix decoding's draft (the
    very tree a suffix proposer alone drafts), one whose text never repeats the drafter's (the
    tree the drafter alone grows); the drafter skipped meanwhile catches up later on every
    position it missed (its tree equals a dense recomputation's)."""
    target = tiny["loaded"]
    head = random_head(target, vocab=list(range(3, 60)))
    drafter = Eagle3Drafter(head.config, head, target.model.embed_tokens, None)
    engine = EngineConfig(max_num_seqs=2, max_model_len=256, num_kv_blocks=64, block_size=4)
    hybrid = Eagle3Proposer(drafter, target, engine, max_nodes=7, topk=3, suffix=SuffixFirst(SuffixProposer(), 1.0))
    alone = Eagle3Proposer(drafter, target, engine, max_nodes=7, topk=3)
    h3 = 3 * target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    seqs = {"rep": [5, 9, 14, 22] * 6, "new": torch.randperm(50, generator=gen)[:20].add(3).tolist()}
    states = {r: torch.randn(len(s) + 6, h3, generator=gen) for r, s in seqs.items()}
    for prop in (hybrid, alone):
        for rid, s in seqs.items():
            prop.add_request(rid, s)
            prop.observe_hidden(rid, 0, states[rid][:len(s) - 1])
    batch = [SpecRequest(rid, s, 4, GREEDY, None, max_nodes=7) for rid, s in seqs.items()]
    got = hybrid.propose(batch).trees
    want_suffix, expected = SuffixProposer().draft(batch[0])
    assert expected >= 1.0 and got[0].num_nodes > 0
    assert (got[0].token_ids, got[0].parents) == (want_suffix.token_ids, want_suffix.parents)
    assert tree_paths(got[1]) == tree_paths(alone.propose(batch).trees[1]) and got[1].num_nodes == 7
    assert (hybrid.times.suffix_drafts, hybrid.times.drafter_drafts) == (1, 1)
    assert hybrid.times.as_dict()["suffix_share"] == 0.5
    # Three tokens committed to each; then the repeating request too drafts with the drafter,
    # which has not seen it yet: its catch-up covers the whole text.
    for rid, s in seqs.items():
        n = len(s)
        seqs[rid] = s + [5, 9, 14] if rid == "rep" else s + [60, 61, 62]
        hybrid.observe_hidden(rid, n - 1, states[rid][n - 1:n + 2])
    hybrid.suffix.threshold = float("inf")
    batch = [SpecRequest(rid, s, 4, GREEDY, None, max_nodes=7) for rid, s in seqs.items()]
    got = hybrid.propose(batch).trees
    for (rid, s), tree in zip(seqs.items(), got):
        want = reference_tree(head, target.model.embed_tokens, states[rid][:len(s) - 1], s, 0, 4, 3, 7)
        assert tree_paths(tree) == want, rid


# ---- end to end --------------------------------------------------------------------------------

def save_random_drafter(folder, target, **kw):
    from specserve.spec.heads.eagle3_checkpoint import write_eagle3

    head = random_head(target, **kw)
    write_eagle3(folder, head.config, head.state_dict(), {})
    return str(folder)


def outputs(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], LLM.aggregate_spec_stats(outs)


@pytest.mark.parametrize("max_num_seqs, window", [(1, None), (4, None), (4, 3)])
def test_greedy_eagle3_equals_plain_on_the_torch_path(tiny, tmp_path, monkeypatch, max_num_seqs, window):
    """A random drafter (most drafts rejected) over a float32 target: every output is plain's,
    single and batched, and the drafter reads the layers it names (a shallow target repeats one).
    With a catch-up window of 3, drafters more than 3 tokens behind (every prompt, at its first
    draft) restart from their last 3 tokens, and the output is still plain's."""
    folder = save_random_drafter(tmp_path / "d", tiny["loaded"], aux=(0, 1, 1), vocab=list(range(2, 50)))
    prompts = ragged_prompts(5, seed=2)
    plain, _ = outputs(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts)
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=max_num_seqs, speculative_config={
        "method": "eagle3", "model": folder, "num_speculative_tokens": 3, "num_draft_nodes": 6,
        "catch_up_window": window})
    assert llm.engine.proposer.drafter.native is None
    kv = llm.engine.proposer.kv
    begun = []  # (committed tokens, first catch-up position, features fed)
    real_begin = kv.begin

    def begin(request_id, num_tokens, lookahead, window=None):
        got = real_begin(request_id, num_tokens, lookahead, window)
        if got is not None:
            begun.append((num_tokens, got[0], len(got[1])))
            assert kv.first(request_id) <= got[0] and got[0] + len(got[1]) == num_tokens - 1
        return got

    monkeypatch.setattr(kv, "begin", begin)
    got, stats = outputs(llm, prompts)
    assert got == plain and stats.num_drafted > 0
    fed = [c for _, _, c in begun]
    if window is None:
        assert max(fed) > 3  # the prompts are caught up on whole
    else:
        assert max(fed) == 3 and any(start > 0 for _, start, _ in begun)


def test_greedy_eagle3_with_suffix_decoding_equals_plain(tiny, tmp_path):
    """Suffix decoding beside a random drafter, batched: both draft (the prompts repeat a phrase,
    the drafter's guesses are random) and every output is plain's."""
    folder = save_random_drafter(tmp_path / "d", tiny["loaded"], aux=(0, 1, 1), vocab=list(range(2, 50)))
    prompts = ragged_prompts(6, seed=4, lo=4)
    plain, _ = outputs(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts)
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=3, speculative_config={
        "method": "eagle3", "model": folder, "num_speculative_tokens": 3, "num_draft_nodes": 6,
        "enable_suffix_decoding": True, "suffix_threshold": 1.5})
    got, stats = outputs(llm, prompts)
    times = llm.engine.proposer.times
    assert got == plain and stats.num_accepted > 0
    assert times.suffix_drafts > 0 and times.drafter_drafts > 0


@pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
def test_the_shipped_drafter_drafts_losslessly_and_is_accepted(smollm_native):
    """`"model": "default"`: the EAGLE-3 drafter shipped for the embedded model, in SpecForge's
    layout with specserve's target record, is found, checked against the target, drafts on the
    native kernels from the three states the target's own pass captured, and drafts tokens the
    target accepts, with output identical to plain decoding."""
    prompts = [smollm_native.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in (
        "Explain how a bicycle works.", "List three uses of water.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    plain, _ = outputs(LLM(loaded=smollm_native, max_num_seqs=2), prompts, params)
    sizes = {}
    for quantization in ("q8_0", "q4_0"):  # the drafter's matrices in either format: only proposals
        llm = LLM(loaded=smollm_native, max_num_seqs=2, speculative_config={
            "method": "eagle3", "model": "default", "num_speculative_tokens": 3, "quantization": quantization})
        drafter = llm.engine.proposer.drafter.native
        assert drafter is not None and {m.format for m in drafter.matrices.values()} == {
            int(DRAFTER_FORMATS[quantization])}
        got, stats = outputs(llm, prompts, params)
        assert got == plain and stats.num_accepted > 0
        sizes[quantization] = drafter.weight_bytes
    assert sizes["q4_0"] < 0.6 * sizes["q8_0"]  # about half the bytes a drafting depth reads
