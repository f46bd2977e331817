"""The paged pool's semantics, through the padded paged attention kept as the flat path's
reference (tests/paged_reference.py): it computes the dense cache's attention: against an explicit-softmax
reference (float64) for shuffled block tables, ragged batches, prefill chunks, decode and k+1
verification with rollback; and a whole model's logits against the dense cache's.

Tolerance 1e-5, not equality: a gathered key tensor has other strides and a batch other
shapes than the reference's, so SDPA may accumulate in another order (float32 rounding)."""

import pytest
import torch

from specserve.model.attention import DenseKVCache
from specserve.model.hf_loader import load_hf_model, read_hf_config
from specserve.model.paged_kv import PagedKVCache
from tests.paged_reference import PagedReferenceCache
from tests.helpers import make_tiny_checkpoint

TOL = 1e-5
# On CUDA, cuBLAS picks its float32 product kernels (and so their summation order) by the row
# count, so a run in chunks of 1..7 rows and one of 30 rows round differently: measured on an
# H200, 1.6e-5 on logits of magnitude ~6 (a few float32 ulps of the sums). A stale or wrong
# KV read, what the rollback test looks for, moves logits by O(1) or makes them NaN.
CUDA_CHUNKED_TOL = 1e-4
H, HKV, D = 4, 2, 8
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def shuffled_tables(num_requests: int, blocks_each: int, num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, non-contiguous block tables drawn from a random permutation of the pool."""
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [ids[i * blocks_each:(i + 1) * blocks_each] for i in range(num_requests)]


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                        positions: list[int]) -> torch.Tensor:
    """Explicit causal softmax in float64. q: [T, H, D]; keys, values: [L, Hkv, D] (the request's
    whole history); query t sits at positions[t] -> [T, H * D]."""
    rep = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(rep, 1), values.double().repeat_interleave(rep, 1)  # [L, H, D]
    scores = torch.einsum("thd,lhd->htl", q.double(), k) / q.shape[-1] ** 0.5  # [H, T, L]
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # [T, L]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("htl,lhd->thd", probs, v).reshape(q.shape[0], -1)


# Steps of (start_positions, query_lens) per request, chosen so that every kind of step comes
# up: ragged prefill chunks, a mixed chunk + decode step, decode, k+1-token verification, and
# restarts from an earlier position after rejected drafts (rollback).
SCHEDULES = {
    1: [([0], [6]), ([6], [5]), ([11], [1]), ([12], [1]), ([13], [4]), ([14], [1]), ([15], [4]), ([16], [3])],
    3: [([0, 0, 0], [5, 9, 3]), ([5, 9, 3], [7, 1, 6]), ([12, 10, 9], [1, 1, 1]), ([13, 11, 10], [4, 4, 4]),
        ([14, 11, 13], [1, 3, 2]), ([15, 14, 15], [1, 1, 1])],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bsz,block_size,contiguous", [(1, 4, False), (1, 4, True), (1, 1, False),
                                                       (3, 4, False), (3, 5, False)])
def test_attend_matches_explicit_softmax(device, bsz, block_size, contiguous):
    g = torch.Generator().manual_seed(bsz * 100 + block_size)
    blocks_each = -(-24 // block_size)
    num_blocks = bsz * blocks_each + 3
    cache = PagedReferenceCache(2, num_blocks, block_size, HKV, D, torch.float32, device)
    tables = ([list(range(2, 2 + blocks_each))] if contiguous
              else shuffled_tables(bsz, blocks_each, num_blocks, seed=block_size))
    layer = 1
    hist_k = [torch.zeros(0, HKV, D) for _ in range(bsz)]  # each request's true keys by position
    hist_v = [torch.zeros(0, HKV, D) for _ in range(bsz)]
    for starts, lens in SCHEDULES[bsz]:
        t = max(lens)
        q = torch.randn(bsz, t, H, D, generator=g)
        k = torch.randn(bsz, t, HKV, D, generator=g)
        v = torch.randn(bsz, t, HKV, D, generator=g)
        meta = cache.metadata(tables, starts, lens)
        if bsz == 1:
            assert (meta.first_block is not None) == contiguous
            assert (meta.mask is None) == (t == 1)
        out = cache.attend(layer, q.to(device), k.to(device), v.to(device), meta).cpu()  # [B, T, H * D]
        assert out.shape == (bsz, t, H * D)
        for i, (s, n) in enumerate(zip(starts, lens)):
            # A start below the history's end is a rollback: the tail is stale, never to be read.
            hist_k[i] = torch.cat([hist_k[i][:s], k[i, :n]])
            hist_v[i] = torch.cat([hist_v[i][:s], v[i, :n]])
            ref = reference_attention(q[i, :n], hist_k[i], hist_v[i], list(range(s, s + n)))
            assert (out[i, :n].double() - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("device", DEVICES)
def test_rolled_back_slots_are_never_read(device):
    """After a rollback the stale slots hold NaN: one read of them would poison the output."""
    g = torch.Generator().manual_seed(7)
    cache = PagedReferenceCache(1, 8, 4, HKV, D, torch.float32, device)
    table = [5, 1, 6, 3]
    k, v = torch.randn(1, 14, HKV, D, generator=g), torch.randn(1, 14, HKV, D, generator=g)
    q = torch.randn(1, 14, H, D, generator=g)
    cache.attend(0, q[:, :10].to(device), k[:, :10].to(device), v[:, :10].to(device),
                 cache.metadata([table], [0], [10]))
    stale = cache.metadata([table], [10], [4]).write_index  # a 3-token draft plus bonus at 10..13
    cache.k_slots[0][stale] = float("nan")
    cache.v_slots[0][stale] = float("nan")
    for s, n in ((7, 1), (8, 2)):  # drafts rejected back to position 7; then a 2-token step
        out = cache.attend(0, q[:, s:s + n].to(device), k[:, s:s + n].to(device), v[:, s:s + n].to(device),
                           cache.metadata([table], [s], [n])).cpu()
        ref = reference_attention(q[0, s:s + n], k[0, :s + n], v[0, :s + n], list(range(s, s + n)))
        assert (out[0].double() - ref).abs().max().item() <= TOL


def test_metadata_positions_and_slots():
    cache = PagedReferenceCache(1, 10, 4, HKV, D, torch.float32, "cpu")
    dense = DenseKVCache(1, 2, 16, HKV, D, torch.float32, "cpu")
    meta = cache.metadata([[7, 2], [4, 0, 9]], [3, 6], [2, 3])
    assert torch.equal(meta.positions, dense.metadata([0, 1], [3, 6], [2, 3]).positions)
    assert meta.positions.tolist() == [[3, 4, 0], [6, 7, 8]]
    # position 3 -> block 7 offset 3; 4 -> block 2 offset 0; padding -> trash block 10; 6..8 -> block 0, then 9
    assert meta.write_index.tolist() == [7 * 4 + 3, 2 * 4, 10 * 4, 0 * 4 + 2, 0 * 4 + 3, 9 * 4]
    assert meta.context_len == 9
    assert meta.block_tables.tolist() == [[7, 2, 7], [4, 0, 9]]  # short rows padded with their first block
    assert meta.mask.shape == (2, 1, 3, 9)
    assert torch.equal(meta.mask[0, 0, 0] == 0, torch.arange(9) <= 3)
    # a table longer than needed is fine; one too short is refused
    assert cache.metadata([[1, 2, 3]], [0], [4]).block_tables.tolist() == [[1]]
    assert cache.metadata([[1, 2, 3]], [0], [4]).first_block == 1
    with pytest.raises(ValueError, match="needs 2 blocks"):
        cache.metadata([[1]], [3], [2])
    with pytest.raises(ValueError, match="block ids"):
        cache.metadata([[10]], [0], [1])


def test_budget_helper_sizes_the_pools():
    args = dict(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8)
    per_block = PagedKVCache.bytes_per_block(**args, dtype=torch.bfloat16)
    assert per_block == 2 * 3 * 16 * 2 * 8 * 2
    budget = 10 * per_block + per_block // 2
    n = PagedKVCache.num_blocks_for_budget(budget, **args, dtype=torch.bfloat16)
    assert n == 9  # one block of the ten goes to the trash block
    make = lambda blocks: PagedKVCache(args["num_layers"], blocks, 16, 2, 8, torch.bfloat16, "cpu")  # noqa: E731
    assert make(n).nbytes() <= budget < make(n + 1).nbytes()
    assert PagedKVCache.num_blocks_for_budget(per_block, **args, dtype=torch.bfloat16) == 0
    assert PagedKVCache.num_blocks_for_budget(10 * per_block, **args, dtype=torch.float32) == 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("paged") / "m", kind="llama", heads=4, kv_heads=2)
    cfg = read_hf_config(folder)
    return cfg, folder


def load(tiny_model, device):
    cfg, folder = tiny_model
    return cfg, load_hf_model(folder, cfg, torch.float32, device)


@pytest.mark.parametrize("device", DEVICES)
def test_model_logits_equal_dense_cache(tiny_model, device):
    """Two ragged requests through chunked prefill, a mixed chunk + decode step, decode, a
    4-token verification, rollback to different accepted lengths, and more decode: the same
    steps on a paged and on a dense cache give the same logits."""
    cfg, model = load(tiny_model, device)
    g = torch.Generator().manual_seed(3)
    block_size = 4
    paged = PagedReferenceCache(cfg.num_layers, 24, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    dense = DenseKVCache(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    tables = shuffled_tables(2, 8, 24, seed=5)
    steps = [([0, 0], [5, 8]), ([5, 8], [8, 8]), ([13, 16], [1, 5]), ([14, 21], [1, 1]), ([15, 22], [1, 1]),
             ([16, 23], [4, 4]), ([18, 23], [1, 1]), ([19, 24], [1, 1]), ([20, 25], [3, 1])]
    with torch.no_grad():
        for starts, lens in steps:
            ids = torch.randint(0, cfg.vocab_size, (2, max(lens)), generator=g).to(device)
            mine = model.compute_logits(model(ids, paged.metadata(tables, starts, lens), paged))
            ref = model.compute_logits(model(ids, dense.metadata([1, 0], starts, lens), dense))
            for i, n in enumerate(lens):
                assert (mine[i, :n] - ref[i, :n]).abs().max().item() <= TOL


@pytest.mark.parametrize("device", DEVICES)
def test_model_rollback_equals_fresh_run(tiny_model, device):
    """Chunked prefill, decode, 3 draft tokens (+1) written then all but one rejected: the
    continued run's logits equal a fresh dense run of the accepted tokens alone, and the
    rejected slots, filled with NaN, are never read."""
    cfg, model = load(tiny_model, device)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, cfg.vocab_size, (1, 30), generator=g).to(device)
    draft = torch.randint(0, cfg.vocab_size, (1, 4), generator=g).to(device)
    paged = PagedReferenceCache(cfg.num_layers, 12, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    table = [9, 2, 7, 0, 11, 4, 5, 10]
    fresh = DenseKVCache(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, device)
    with torch.no_grad():
        ref = model.compute_logits(model(tokens, fresh.metadata([0], [0], [30]), fresh))[0]  # [30, vocab]

        def step(ids, start):
            return model.compute_logits(model(ids, paged.metadata([table], [start], [ids.shape[1]]), paged))[0]

        got = [step(tokens[:, 0:7], 0), step(tokens[:, 7:13], 7), step(tokens[:, 13:18], 13)]  # chunked prefill
        got += [step(tokens[:, p:p + 1], p) for p in (18, 19)]  # decode
        # verification of [token 20, 3 drafts] at 20..23; the draft at 21 is rejected
        got.append(step(torch.cat([tokens[:, 20:21], draft[:, 1:]], 1), 20)[:1])
        stale = paged.metadata([table], [21], [3]).write_index
        for layer in range(cfg.num_layers):
            paged.k_slots[layer][stale] = float("nan")
            paged.v_slots[layer][stale] = float("nan")
        got += [step(tokens[:, 21:22], 21), step(tokens[:, 22:26], 22)]  # continue, then a 4-token step
        got += [step(tokens[:, p:p + 1], p) for p in range(26, 30)]
        mine = torch.cat(got)
        assert mine.shape == ref.shape
        assert (mine - ref).abs().max().item() <= (TOL if device == "cpu" else CUDA_CHUNKED_TOL)


def test_group_rows():
    from specserve.model.flat_attention import group_rows
    assert group_rows([100, 120, 90]) is None  # all within the floor: one call
    assert group_rows([600, 100, 120, 590]) == [[0, 3], [2, 1]]  # longest contexts first
    assert group_rows([600, 400, 350]) is None  # within a factor 2 of the longest
    assert group_rows([1000, 260, 100]) == [[0], [1, 2]]
    assert group_rows([1000, 600, 300]) is None  # two groups reading 1000 + 2 * 600 > 0.75 * 3000


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_rows_match_explicit_softmax(device):
    """A batch of long and short contexts attends in groups (each padded to its own longest
    context), decode rows and multi-token rows mixed, one of them a token tree."""
    g = torch.Generator().manual_seed(11)
    bs, starts, lens = 16, [900, 40, 700, 10, 850, 3], [1, 3, 4, 1, 2, 5]
    blocks_each = -(-max(s + q for s, q in zip(starts, lens)) // bs)
    cache = PagedReferenceCache(1, len(starts) * blocks_each + 1, bs, HKV, D, torch.float32, device)
    tables = shuffled_tables(len(starts), blocks_each, len(starts) * blocks_each + 1, seed=3)
    hist = [(torch.randn(s + q, HKV, D, generator=g), torch.randn(s + q, HKV, D, generator=g)) for s, q in zip(starts, lens)]
    for i, (hk, hv) in enumerate(hist):  # write each history up to its start
        if starts[i]:
            cache.attend(0, torch.zeros(1, starts[i], H, D, device=device), hk[None, : starts[i]].to(device),
                         hv[None, : starts[i]].to(device), cache.metadata([tables[i]], [0], [starts[i]]))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)  # row 2: a tree
    meta = cache.metadata(tables, starts, lens, tree_masks=[None, None, tree, None, None, None])
    assert meta.groups is not None and len(meta.groups) == 2
    assert [gr.context_len for gr in meta.groups] == [901, 43]
    t = max(lens)
    q = torch.randn(len(starts), t, H, D, generator=g)
    k = torch.stack([torch.cat([hk[s:], torch.zeros(t - q_, HKV, D)]) for (hk, _), s, q_ in zip(hist, starts, lens)])
    v = torch.stack([torch.cat([hv[s:], torch.zeros(t - q_, HKV, D)]) for (_, hv), s, q_ in zip(hist, starts, lens)])
    out = cache.attend(0, q.to(device), k.to(device), v.to(device), meta).cpu()
    for i, (s, n) in enumerate(zip(starts, lens)):
        if i == 2:  # node j sees the context and its ancestors: explicit softmax per node
            for j in range(n):
                seen = list(range(s)) + [s + m for m in range(n) if tree[j, m]]
                ref = reference_attention(q[i, j:j + 1], hist[i][0][seen], hist[i][1][seen], [len(seen) - 1])
                assert (out[i, j].double() - ref[0]).abs().max().item() <= TOL
        else:
            ref = reference_attention(q[i, :n], hist[i][0], hist[i][1], list(range(s, s + n)))
            assert (out[i, :n].double() - ref).abs().max().item() <= TOL
