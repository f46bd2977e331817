"""The native EAGLE-3 drafter against the torch module (eagle3.py) on the same dequantized
weights, with a dense reference attention written here (tolerance: the native path quantizes
activations to int8 before every product); every CPU level against the generic C++ (exact);
kv_start in the attention kernel itself (exact, every level); bad input refused."""

import copy
import math
from dataclasses import replace

import pytest
import torch

from specserve import native
from specserve.hardware import Isa, machine
from specserve.model.flat_batch import flat_batch
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import Eagle3Config
from specserve.spec.heads.native_eagle3 import NativeEagle3Drafter
from tests.helpers import native_levels

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")

LEVELS = [int(lvl) for lvl in native_levels()]  # generic .. the highest level the kernels run here
CFG = Eagle3Config(hidden_size=64, target_hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=256, vocab_size=500, draft_vocab_size=96, aux_layers=(0, 1, 2))
BLOCK = 4
TABLES = [[3, 0, 5], [1, 4, 2]]  # each sequence's blocks, out of order, in a pool of 6
POOL_ROWS = 6 * BLOCK
SEQ_SLOTS = 3 * BLOCK
# Relative error of out and logits against the reference (measured over these steps and four
# seeds: 0.014-0.028, Q8_0 weights and int8 activations): a bound a few times the typical figure.
MAX_REL = 0.08


def make_head(cfg: Eagle3Config = CFG, seed: int = 0) -> Eagle3Head:
    """Random weights large enough for peaked attention and logits; norms near 1, not 1."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 2.0 / p.shape[-1] ** 0.5)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return head.eval()


class DenseDraftCache:
    """The reference of the drafter's paged cache: each sequence's slots densely, keys and values
    rounded to halves as the pool keeps them, NaN where never written. `meta` of one call:
    (sequence, the slots its tokens write [T], which slots each token sees [T, slots] bool)."""

    def __init__(self, cfg: Eagle3Config, num_seqs: int):
        shape = (num_seqs, SEQ_SLOTS, cfg.num_kv_heads, cfg.head_dim)
        self.k, self.v = torch.full(shape, math.nan), torch.full(shape, math.nan)
        self.group = cfg.num_heads // cfg.num_kv_heads

    def attend(self, layer, q, k, v, meta):
        """q [T, heads, D], k, v [T, kv_heads, D] -> [T, heads * D]."""
        seq, write_at, visible = meta
        self.k[seq, write_at] = k.half().float()
        self.v[seq, write_at] = v.half().float()
        out = []
        for t in range(q.shape[0]):
            seen = visible[t].nonzero().squeeze(-1)
            keys = self.k[seq, seen].repeat_interleave(self.group, dim=1)  # [S, heads, D]
            values = self.v[seq, seen].repeat_interleave(self.group, dim=1)
            w = (torch.einsum("hd,shd->hs", q[t], keys) / math.sqrt(q.shape[-1])).softmax(-1)
            out.append(torch.einsum("hs,shd->hd", w, values).reshape(-1))
        return torch.stack(out)


@pytest.fixture(scope="module")
def pair():
    """The native drafter and the torch module on the weights its products use."""
    head = make_head()
    drafter = NativeEagle3Drafter.from_head(head, native.load(), LEVELS[-1])
    ref = copy.deepcopy(head)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, w in drafter.dequantized().items():
            params[name].copy_(w)
    return drafter, ref


def nan_pool(drafter):
    shape = drafter.cache_shape(POOL_ROWS)
    return torch.full(shape, math.nan, dtype=torch.float16), torch.full(shape, math.nan, dtype=torch.float16)


def step_both(drafter, ref, pool, ref_cache, seqs, tree, fused, kv_start=None, seed=0):
    """One call for the sequences seqs = [(first slot, tokens)]: chains (each token sees the
    slots before it and itself) or, with `tree`, one depth of nodes that see the context before
    their first slot and themselves. -> native (out, logits), reference (out, logits)."""
    g = torch.Generator().manual_seed(seed)
    n, h = sum(c for _, c in seqs), CFG.hidden_size
    embeds = torch.randn(n, h, generator=g)
    feature = torch.randn(n, 3 * CFG.target_hidden_size if fused else h, generator=g)
    masks = [torch.eye(c, dtype=torch.bool) for _, c in seqs] if tree else None
    fb = flat_batch([[0] * c for _, c in seqs], TABLES, BLOCK, [s for s, _ in seqs], masks)
    starts = None if kv_start is None else torch.tensor(kv_start)
    got = drafter.step(embeds, feature, fb.positions, fb.slots, pool[0], pool[1], BLOCK, fb.q_start,
                       fb.block_table, fb.prefix_len, starts, fb.tree_row, fb.tree_start, fb.tree_size, fb.tree_mask)
    outs, logits = [], []
    for i, (start, count) in enumerate(seqs):
        rows = slice(int(fb.q_start[i]), int(fb.q_start[i + 1]))
        k0 = 0 if kv_start is None else kv_start[i]
        visible = torch.zeros(count, SEQ_SLOTS, dtype=torch.bool)
        for j in range(count):
            if tree:
                visible[j, k0:start] = True
                visible[j, start + j] = True
            else:
                visible[j, k0:start + j + 1] = True
        meta = (i, torch.arange(start, start + count), visible)
        with torch.no_grad():
            feat = ref.fuse(feature[rows]) if fused else feature[rows]
            out = ref(embeds[rows], feat, fb.positions[rows], meta, ref_cache)
        outs.append(out)
        logits.append(ref.logits(out))
    return got, (torch.cat(outs), torch.cat(logits))


def scenario(drafter, ref):
    """(1) two sequences catch up 5 and 3 positions (fc applied); (2) one tree depth of 2 nodes
    each after the context (feature [n, H]); (3) on a fresh cache, kv_start 4 and 2: the slots
    before were never written (NaN halves), then a tree depth there too. -> [(got, want)]."""
    results = []
    pool, ref_cache = nan_pool(drafter), DenseDraftCache(CFG, 2)
    results.append(step_both(drafter, ref, pool, ref_cache, [(0, 5), (0, 3)], tree=False, fused=True, seed=1))
    results.append(step_both(drafter, ref, pool, ref_cache, [(5, 2), (3, 2)], tree=True, fused=False, seed=2))
    pool, ref_cache = nan_pool(drafter), DenseDraftCache(CFG, 2)
    results.append(step_both(drafter, ref, pool, ref_cache, [(4, 4), (2, 3)], tree=False, fused=True,
                             kv_start=[4, 2], seed=3))
    results.append(step_both(drafter, ref, pool, ref_cache, [(8, 2), (5, 2)], tree=True, fused=False,
                             kv_start=[4, 2], seed=4))
    return results, pool


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("level", [LEVELS[0], LEVELS[-1]], ids=["lowest", "highest"])
def test_native_drafter_matches_the_torch_module(pair, level):
    drafter, ref = pair
    drafter.level = level
    results, _ = scenario(drafter, ref)
    for i, ((out, logits), (want_out, want_logits)) in enumerate(results):
        assert out.shape == (want_out.shape[0], CFG.hidden_size) and logits.shape == (out.shape[0], 96)
        assert torch.isfinite(out).all() and torch.isfinite(logits).all(), i
        assert rel(out, want_out) < MAX_REL and rel(logits, want_logits) < MAX_REL, (i, rel(out, want_out),
                                                                                     rel(logits, want_logits))


def test_every_level_computes_the_same_bits(pair):
    drafter, ref = pair
    runs = []
    for level in LEVELS:
        drafter.level = level
        runs.append(scenario(drafter, ref))
    (first, first_pool) = runs[0]
    for level, (results, pool) in zip(LEVELS[1:], runs[1:]):
        for (got, _), (want, _) in zip(results, first):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), Isa(level).label
        assert torch.equal(pool[0].view(torch.int16), first_pool[0].view(torch.int16)), Isa(level).label
        assert torch.equal(pool[1].view(torch.int16), first_pool[1].view(torch.int16)), Isa(level).label


def test_norm_before_residual_and_a_padded_vocabulary():
    """speculators' variant (the normed feature is the residual) and Vd = 90, not a multiple of 16."""
    cfg = replace(CFG, norm_before_residual=True, draft_vocab_size=90)
    head = make_head(cfg, seed=5)
    drafter = NativeEagle3Drafter.from_head(head, native.load(), LEVELS[-1])
    ref = copy.deepcopy(head)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, w in drafter.dequantized().items():
            params[name].copy_(w)
    pool, ref_cache = nan_pool(drafter), DenseDraftCache(cfg, 2)
    (out, logits), (want_out, want_logits) = step_both(drafter, ref, pool, ref_cache, [(0, 5), (0, 3)], tree=False,
                                                       fused=True, seed=6)
    assert logits.shape == (8, 90)
    assert rel(out, want_out) < MAX_REL and rel(logits, want_logits) < MAX_REL


@pytest.mark.parametrize("level", [LEVELS[0], LEVELS[-1]], ids=["lowest", "highest"])
def test_last_only_returns_the_full_calls_last_rows_and_writes_the_same_cache(pair, level):
    """A catch-up with last_only (each sequence's last token alone goes past its key and value)
    gives the full call's rows at each sequence's end, bit for bit, and the same cache; then a
    tree depth over either cache gives the same bits. With kv_start, and one sequence of a
    single token."""
    drafter, _ = pair
    drafter.level = level
    g = torch.Generator().manual_seed(11)
    seqs, starts = [(2, 6), (3, 1)], torch.tensor([2, 3])
    n = sum(c for _, c in seqs)
    embeds, feature = torch.randn(n, CFG.hidden_size, generator=g), torch.randn(n, 3 * CFG.target_hidden_size,
                                                                             generator=g)
    fb = flat_batch([[0] * c for _, c in seqs], TABLES, BLOCK, [s for s, _ in seqs])
    args = (fb.positions, fb.slots)
    meta = (BLOCK, fb.q_start, fb.block_table, fb.prefix_len, starts)
    full_pool, last_pool = nan_pool(drafter), nan_pool(drafter)
    out, logits = drafter.step(embeds, feature, *args, *full_pool, *meta)
    got_out, got_logits = drafter.step(embeds, feature, *args, *last_pool, *meta, last_only=True)
    ends = fb.q_start[1:] - 1
    assert got_out.shape == (2, CFG.hidden_size) and got_logits.shape == (2, 96)
    assert torch.equal(got_out, out[ends]) and torch.equal(got_logits, logits[ends])
    for a, b in zip(full_pool, last_pool):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    tree = flat_batch([[0, 0], [0, 0]], TABLES, BLOCK, [8, 4], [torch.eye(2, dtype=torch.bool)] * 2)
    feat = torch.randn(4, CFG.hidden_size, generator=g)
    depth = [drafter.step(embeds[:4].contiguous(), feat, tree.positions, tree.slots, *pool, BLOCK, tree.q_start,
                          tree.block_table, tree.prefix_len, starts, tree.tree_row, tree.tree_start,
                          tree.tree_size, tree.tree_mask) for pool in (full_pool, last_pool)]
    assert torch.equal(depth[0][0], depth[1][0]) and torch.equal(depth[0][1], depth[1][1])
    with pytest.raises(RuntimeError, match="last_only takes no tree"):
        drafter.step(embeds[:4].contiguous(), feat, tree.positions, tree.slots, *last_pool, BLOCK, tree.q_start,
                     tree.block_table, tree.prefix_len, starts, tree.tree_row, tree.tree_start, tree.tree_size,
                     tree.tree_mask, last_only=True)


@pytest.mark.parametrize("level", LEVELS, ids=[Isa(lvl).label for lvl in LEVELS])
def test_kv_start_hides_the_earlier_slots_in_the_kernel(level):
    """kv_start 4 over the blocks [2, 0, 3] is the same attention, bit for bit, as no kv_start
    over [0, 3] with everything counted 4 slots earlier, chains and tree nodes alike; block 2
    holds NaN and is never read."""
    ext = native.load()
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, d = 4, 2, 16
    k = torch.randn(4, BLOCK, kv_heads, d, generator=g).half()
    v = torch.randn(4, BLOCK, kv_heads, d, generator=g).half()
    k[2], v[2] = math.nan, math.nan
    q = torch.randn(5, heads, d, generator=g)
    tree = dict(tree_row=torch.tensor([-1, -1, -1, 0, 2]), tree_start=torch.tensor([10]),
                tree_size=torch.tensor([2]), tree_mask=torch.tensor([1, 0, 1, 1], dtype=torch.uint8))
    prefix = torch.tensor([6, 9, 10, 10, 10])  # chains at slots 5, 8, 9; two tree nodes at 10, 11
    hidden = ext.paged_attention(level, q, k, v, torch.tensor([0, 5]), torch.tensor([[2, 0, 3]]), prefix,
                                 kv_start=torch.tensor([4]), **tree)
    shifted = ext.paged_attention(level, q, k, v, torch.tensor([0, 5]), torch.tensor([[0, 3]]), prefix - 4,
                                  **{**tree, "tree_start": torch.tensor([6])})
    assert torch.isfinite(hidden).all() and torch.equal(hidden, shifted)
    with pytest.raises(RuntimeError, match=r"kv_start\[0\] = -1 must be >= 0"):
        ext.paged_attention(level, q, k, v, torch.tensor([0, 5]), torch.tensor([[2, 0, 3]]), prefix,
                            kv_start=torch.tensor([-1]))


def test_bad_input_is_refused(pair):
    drafter, _ = pair
    pool = nan_pool(drafter)
    fb = flat_batch([[0, 0]], TABLES[:1], BLOCK, [0])
    meta = (fb.positions, fb.slots, pool[0], pool[1], BLOCK, fb.q_start, fb.block_table, fb.prefix_len)
    embeds = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match=r"feature must be contiguous float32 \[2, 64\] or \[n, 3 \* target_hidden"):
        drafter.step(embeds, torch.zeros(2, 100), *meta)
    with pytest.raises(RuntimeError, match=r"kv_start\[0\] = -3 must be >= 0"):
        drafter.step(embeds, torch.zeros(2, 64), *meta, torch.tensor([-3]))
    with pytest.raises(RuntimeError, match="kv_start must be contiguous int64"):
        drafter.step(embeds, torch.zeros(2, 64), *meta, torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="position 300 lies outside the RoPE tables"):
        drafter.step(embeds, torch.zeros(2, 64), torch.tensor([0, 300]), *meta[1:])
    with pytest.raises(RuntimeError, match=r"k_cache and v_cache must be contiguous float16 \[1, rows"):
        drafter.step(embeds, torch.zeros(2, 64), fb.positions, fb.slots, pool[0].float(), pool[1], *meta[4:])
