"""The torch model's flattened pass (LlamaModel.forward_flat over flat_attention.py) against the
padded per-request path (LlamaModel.forward over tests/paged_reference.py's cache): prompt chunks at
nonzero starts, decodes, draft chains and token trees of ragged requests in one call, on
shuffled block tables; the keys and values it writes; a request alone against inside a big
batch; its attention against the native kernel's on the same FlatBatch.

Tolerance 1e-5 (float32), not equality: the flat pass multiplies [N, hidden] rows where the
padded path multiplies [1, T, hidden] ones, and attends in groups of other shapes, so oneDNN and
SDPA may accumulate in another order. Each case runs with the default grouping, with every
query-length class in its own group (no merging: most scatters) and with one group for all
(most padding)."""

from __future__ import annotations

import pytest
import torch

from specserve import native
from specserve.drafts.tree import DraftTree
from specserve.model import flat_attention
from specserve.model.flat_attention import FlatKV, GatherBuffers, flat_metadata, group_requests
from specserve.model.flat_batch import flat_batch
from specserve.model.loader import load_model
from tests.paged_reference import PagedReferenceCache

TOL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
# _GROUP_COST values: the default; 0 (a class joins another only when that costs nothing: most
# groups); huge (every request in one group: most padding).
GROUPINGS = [None, 0, 10**12]
BLOCK = 4
TREE = DraftTree([11, 12, 13, 14, 15], [-1, -1, 0, 0, 1])
WIDE = DraftTree([21, 22, 23, 24, 25, 26, 27], [-1, -1, -1, 0, 0, 2, 5])


@pytest.fixture(params=GROUPINGS, ids=["default", "split", "one-group"])
def grouping(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setattr(flat_attention, "_GROUP_COST", request.param)
    return request.param


@pytest.fixture(scope="module", params=DEVICES)
def model(request, tiny):
    return tiny["loaded"].model if request.param == "cpu" else load_model(tiny["target"], device="cuda").model


def _cache(model, num_blocks: int) -> PagedReferenceCache:
    cfg = model.config
    return PagedReferenceCache(cfg.num_layers, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.dtype, model.device)


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, block, Hkv, D] -> [layers, rows, Hkv, D], the view forward_flat takes."""
    return pool.view(pool.shape[0], -1, *pool.shape[-2:])


def _tables(num_requests: int, blocks_each: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous) block tables."""
    ids = torch.randperm(num_requests * blocks_each, generator=torch.Generator().manual_seed(seed)).tolist()
    return [ids[i * blocks_each:(i + 1) * blocks_each] for i in range(num_requests)]


def _prefill(model, cache: PagedReferenceCache, tables, starts, seed: int) -> None:
    """Write each request's history [0, start) through the padded path."""
    g = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for table, s in zip(tables, starts):
            if s:
                ids = torch.randint(2, model.config.vocab_size, (1, s), generator=g).to(model.device)
                model(ids, cache.metadata([table], [0], [s]), cache)


def _padded(model, cache: PagedReferenceCache, tables, starts, tokens, masks) -> list[torch.Tensor]:
    """Each request alone through the padded path -> its logits [T_i, V]."""
    with torch.inference_mode():
        return [model.compute_logits(model(torch.tensor([t], device=model.device),
                                           cache.metadata([tb], [s], [len(t)], None if m is None else [m]), cache)[0])
                for tb, s, t, m in zip(tables, starts, tokens, masks)]


def _flat(model, cache: PagedReferenceCache, tables, starts, tokens, masks) -> list[torch.Tensor]:
    """All requests in one flattened pass -> each request's logits [T_i, V]."""
    flat = flat_batch(tokens, tables, BLOCK, starts, masks)
    with torch.inference_mode():
        logits = model.compute_logits(model.forward_flat(flat, _rows(cache.k), _rows(cache.v)))  # [N, V]
    q = flat.q_start.tolist()
    return [logits[a:b] for a, b in zip(q, q[1:])]


def _mixed_batch(seed: int):
    """Chunks at nonzero and zero starts, decodes, a draft chain and two token trees."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(2, 64, (n,), generator=g).tolist()  # noqa: E731
    requests = [  # (start, tokens, tree mask)
        (9, tok(7), None),  # a prompt chunk after an earlier one
        (20, tok(1), None),  # decode
        (13, tok(5), None),  # last token + 4 drafts
        (11, [7] + TREE.token_ids, TREE.attention_mask()),
        (0, tok(12), None),  # a first chunk
        (3, tok(1), None),
        (30, [9] + WIDE.token_ids, WIDE.attention_mask()),
        (17, tok(1), None),
    ]
    return [r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests]


def test_mixed_batch_equals_each_request_on_the_padded_path_and_writes_the_same_kv(model, grouping):
    starts, tokens, masks = _mixed_batch(seed=1)
    blocks_each = -(-max(s + len(t) for s, t in zip(starts, tokens)) // BLOCK)
    tables = _tables(len(starts), blocks_each, seed=2)
    ref = _cache(model, len(starts) * blocks_each)
    _prefill(model, ref, tables, starts, seed=3)
    mine = _cache(model, ref.num_blocks)
    mine.k.copy_(ref.k)
    mine.v.copy_(ref.v)

    flat = flat_batch(tokens, tables, BLOCK, starts, masks)
    meta = flat_metadata(flat, model.device, model.dtype)
    expected_groups = {None: None, 0: lambda n: n > 2, 10**12: lambda n: n == 1}[grouping]
    if expected_groups is not None:
        assert expected_groups(len(meta.groups))

    want = _padded(model, ref, tables, starts, tokens, masks)
    got = _flat(model, mine, tables, starts, tokens, masks)
    for i, (w, o) in enumerate(zip(want, got)):
        torch.testing.assert_close(o, w, atol=TOL, rtol=TOL, msg=lambda m, i=i: f"request {i}: {m}")
    # The padded path also wrote its padding into the trash block, which nothing reads.
    torch.testing.assert_close(mine.k[:, : ref.num_blocks], ref.k[:, : ref.num_blocks], atol=TOL, rtol=TOL)
    torch.testing.assert_close(mine.v[:, : ref.num_blocks], ref.v[:, : ref.num_blocks], atol=TOL, rtol=TOL)


def test_a_request_alone_and_inside_a_big_mixed_batch(model, grouping):
    """A draft chain on consecutive blocks (alone: keys are a view of the pool) against the same
    chain among 20 requests of every kind (gathered, grouped, padded)."""
    starts, tokens, masks = _mixed_batch(seed=4)
    starts, tokens, masks = starts * 2 + [5, 40, 2, 25], tokens * 2 + [[3], [4] * 30, [5, 6], [8] * 9], \
        masks * 2 + [None] * 4
    blocks_each = -(-max(s + len(t) for s, t in zip(starts, tokens)) // BLOCK)
    tables = _tables(len(starts), blocks_each, seed=5)
    x_table = list(range(len(starts) * blocks_each, (len(starts) + 1) * blocks_each))
    x_start, x_tokens = 21, [3, 9, 27, 4, 12]
    cache = _cache(model, (len(starts) + 1) * blocks_each)
    _prefill(model, cache, tables + [x_table], starts + [x_start], seed=6)
    k0, v0 = cache.k.clone(), cache.v.clone()

    alone = _flat(model, cache, [x_table], [x_start], [x_tokens], [None])[0]
    assert isinstance(flat_metadata(flat_batch([x_tokens], [x_table], BLOCK, [x_start]), model.device,
                                    model.dtype).groups[0].keys, int)
    cache.k.copy_(k0)
    cache.v.copy_(v0)
    at = len(starts) // 2
    batched = _flat(model, cache, tables[:at] + [x_table] + tables[at:], starts[:at] + [x_start] + starts[at:],
                    tokens[:at] + [x_tokens] + tokens[at:], masks[:at] + [None] + masks[at:])[at]
    torch.testing.assert_close(batched, alone, atol=TOL, rtol=TOL)
    torch.testing.assert_close(alone, _padded(model, cache, [x_table], [x_start], [x_tokens], [None])[0],
                               atol=TOL, rtol=TOL)


def test_group_requests():
    # A long chunk never pads the decodes next to it.
    assert group_requests([256] + [1] * 15, [512] + [200] * 15) == [[0], list(range(1, 16))]
    # A lone chain and a lone decode share a call; 16 of each do not.
    assert group_requests([1, 5], [200, 200]) == [[0, 1]]
    assert group_requests([5] * 16 + [1] * 16, [200] * 32) == [list(range(16)), list(range(16, 32))]
    # Decodes of very different contexts split as group_rows says (longest first).
    assert group_requests([1] * 6, [2000, 100, 120, 90, 2010, 150]) == [[0, 4], [1, 2, 3, 5]]
    assert group_requests([3, 3, 3], [10, 12, 11]) == [[0, 1, 2]]


@pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
def test_attention_equals_the_native_kernel_on_the_same_flat_batch(grouping):
    """One layer's attention: FlatKV.attend against the native model's kernel (layer_ops.h's
    AttentionBatch), float32, at the generic level, on a mixed batch with trees. The native
    kernel reads float16 pools (widened exactly), so the keys and values are drawn in float16
    and the torch path reads the same values in float32."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim = 4, 2, 16
    starts, tokens, masks = _mixed_batch(seed=8)
    blocks_each = -(-max(s + len(t) for s, t in zip(starts, tokens)) // BLOCK)
    tables = _tables(len(starts), blocks_each, seed=9)
    half_k = torch.randn(len(starts) * blocks_each, BLOCK, kv_heads, head_dim, generator=g).half()
    half_v = torch.randn(half_k.shape, generator=g).half()
    pool_k, pool_v = half_k.float(), half_v.float()
    flat = flat_batch(tokens, tables, BLOCK, starts, masks)
    q = torch.randn(flat.num_tokens, heads, head_dim, generator=g)
    want = native.load().paged_attention(0, q, half_k, half_v, flat.q_start, flat.block_table, flat.prefix_len,
                                          flat.tree_row, flat.tree_start, flat.tree_size, flat.tree_mask)
    rows_k, rows_v = pool_k.view(1, -1, kv_heads, head_dim), pool_v.view(1, -1, kv_heads, head_dim)
    # The tokens' own keys and values are already in the pool: the layer's write changes nothing.
    k, v = rows_k[0, flat.slots], rows_v[0, flat.slots]
    meta = flat_metadata(flat, torch.device("cpu"), torch.float32)
    got = FlatKV(rows_k, rows_v, GatherBuffers()).attend(0, q, k, v, meta)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_metadata_moves_to_the_device_in_order():
    """The one-transfer move hands every group its own tensors back (shapes checked on the meta
    device, which has no data: the CPU path skips the move)."""
    starts, tokens, masks = _mixed_batch(seed=10)
    tables = _tables(len(starts), 12, seed=11)
    flat = flat_batch(tokens, tables, BLOCK, starts, masks)
    host = flat_metadata(flat, torch.device("cpu"), torch.float32)
    moved = flat_metadata(flat, torch.device("meta"), torch.float32)
    assert moved.positions.is_meta and moved.positions.shape == host.positions.shape
    for h, m in zip(host.groups, moved.groups, strict=True):
        assert h.shape == m.shape
        for a, b in ((h.queries, m.queries), (h.outputs, m.outputs), (h.keys, m.keys), (h.mask, m.mask)):
            assert type(a) is type(b) and (not isinstance(a, torch.Tensor) or (b.is_meta and a.shape == b.shape))
