"""specserve's native layer kernels (specserve/native/csrc/layer_ops.h): RMSNorm, RoPE, SiLU x up,
GELU x up, soft-capping (tanh_ps), exp_ps, the KV pool's float -> half rounding and paged
attention over float16 pools (soft-capped, through sliding windows).

Two kinds of test, kept apart:
- tolerance: each kernel against a float64 torch reference, within float32 rounding (exp_ps within
  1 ulp of the true value);
- exact: every CPU level this machine has gives the generic C++'s bits; a query's attention output
  is the same bits whatever else shares the call (other sequences, more query tokens, partners); a
  token-tree query equals the causal-chain query of its accepted path; RoPE equals the torch
  path's bits (the same products and sums); rounding to half gives numpy's (= IEEE
  round-to-nearest-even) bits on edge values at every level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specserve import hardware, native
from specserve.model.llama import apply_rope
from specserve.drafts.tree import DraftTree

ext = native.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
# Levels with their own layer kernels that this machine runs (4 and 5 reuse level 2's).
LEVELS = list(range(min(int(hardware.machine().isa), 3) + 1))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    differ = (bits(a) != bits(b)).sum().item()
    assert differ == 0, f"{what}: {differ} of {a.numel()} values differ, max |diff| {(a - b).abs().max().item()}"


# ---- a paged attention call, and its float64 reference --------------------------------------


@dataclass
class Seq:
    """One sequence of an attention call: its query tokens see slots [0, prefix[i]) and, for a
    token-tree query (tree_rows[i] >= 0), the tree slots tree_start + m where tree_mask[row, m]."""

    blocks: list[int]  # block table row
    prefix: list[int]  # [q] prefix_len of each query token
    tree_rows: list[int] | None = None  # [q] row of tree_mask each token uses, -1: none
    tree_start: int = 0
    tree_mask: torch.Tensor | None = None  # [rows, tree_size] bool

    @classmethod
    def chain(cls, blocks: list[int], context: int, num_q: int) -> Seq:
        """num_q causal tokens at slots context .. context + num_q - 1."""
        return cls(blocks, [context + i + 1 for i in range(num_q)])

    @classmethod
    def tree(cls, blocks: list[int], start: int, tree: DraftTree) -> Seq:
        """[root, nodes] of a draft tree at slots start, start + 1, ... (specserve.drafts.tree)."""
        mask = tree.attention_mask()
        return cls(blocks, [start] * mask.shape[0], list(range(mask.shape[0])), start, mask)

    def position(self, i: int) -> int:
        """Query i's position: a chain token's is its slot, a tree node's start + depth - 1."""
        if self.tree_rows is None or self.tree_rows[i] < 0:
            return self.prefix[i] - 1
        return self.tree_start + int(self.tree_mask[self.tree_rows[i]].sum()) - 1

    def key_position(self, p: int) -> int:
        m = p - self.tree_start
        if self.tree_mask is None or not 0 <= m < self.tree_mask.shape[1]:
            return p
        return self.position(m)  # a tree's node m is its query m

    def sees(self, i: int, p: int, window: int = 0) -> bool:
        if window and self.key_position(p) <= self.position(i) - window:
            return False
        if p < self.prefix[i]:
            return True
        if self.tree_rows is None or self.tree_rows[i] < 0:
            return False
        m = p - self.tree_start
        return 0 <= m < self.tree_mask.shape[1] and bool(self.tree_mask[self.tree_rows[i], m])


@dataclass
class Pool:
    k: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] float16, as the native model keeps them
    v: torch.Tensor

    @classmethod
    def random(cls, blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int) -> Pool:
        g = torch.Generator().manual_seed(seed)
        shape = (blocks, block_size, kv_heads, head_dim)
        return cls(torch.randn(shape, generator=g).half(), torch.randn(shape, generator=g).half())

    def slot(self, seq: Seq, p: int) -> tuple[int, int]:
        bs = self.k.shape[1]
        return seq.blocks[p // bs], p % bs


def attend(level: int, q: torch.Tensor, pool: Pool, seqs: list[Seq], scale: float | None = None,
           softcap: float = 0.0, window: int = 0) -> torch.Tensor:
    """q [num_tokens, heads, head_dim], the sequences' tokens in order -> [num_tokens, heads * head_dim]."""
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + len(s.prefix))
    width = max(len(s.blocks) for s in seqs)
    table = torch.tensor([s.blocks + [-1] * (width - len(s.blocks)) for s in seqs], dtype=torch.int64)
    prefix = torch.tensor([p for s in seqs for p in s.prefix], dtype=torch.int64)
    tree = {}
    if any(s.tree_mask is not None for s in seqs):
        rows, masks, offset = [], [], 0
        for s in seqs:
            n = 0 if s.tree_mask is None else s.tree_mask.shape[1]
            rows += [-1 if s.tree_rows is None or r < 0 else offset + r * n for r in (s.tree_rows or [-1] * len(s.prefix))]
            if s.tree_mask is not None:
                masks.append(s.tree_mask.reshape(-1))
                offset += s.tree_mask.numel()
        tree = dict(tree_row=torch.tensor(rows, dtype=torch.int64),
                    tree_start=torch.tensor([s.tree_start for s in seqs], dtype=torch.int64),
                    tree_size=torch.tensor([0 if s.tree_mask is None else s.tree_mask.shape[1] for s in seqs]),
                    tree_mask=torch.cat(masks).to(torch.uint8))
    if window:
        tree["positions"] = torch.tensor([s.position(i) for s in seqs for i in range(len(s.prefix))])
    return ext.paged_attention(level, q, pool.k, pool.v, torch.tensor(starts), table, prefix, scale=scale,
                               softcap=softcap, window=window, **tree)


def reference(q: torch.Tensor, pool: Pool, seqs: list[Seq], scale: float, softcap: float = 0.0,
              window: int = 0) -> torch.Tensor:
    """Explicit softmax over each query's visible slots, in float64 (the pool's halves widened
    exactly, so the kernels' float32 rounding is all that differs)."""
    heads, kv_heads = q.shape[1], pool.k.shape[2]
    out, row = [], 0
    for s in seqs:
        for i in range(len(s.prefix)):
            reach = max(s.prefix[i], s.tree_start + (0 if s.tree_mask is None else s.tree_mask.shape[1]))
            slots = [pool.slot(s, p) for p in range(reach) if s.sees(i, p, window)]
            k = torch.stack([pool.k[b, o] for b, o in slots]).double().repeat_interleave(heads // kv_heads, 1)
            v = torch.stack([pool.v[b, o] for b, o in slots]).double().repeat_interleave(heads // kv_heads, 1)
            scores = torch.einsum("hd,lhd->hl", q[row].double(), k) * scale
            probs = (torch.tanh(scores / softcap) * softcap if softcap else scores).softmax(-1)
            out.append(torch.einsum("hl,lhd->hd", probs, v).reshape(-1))
            row += 1
    return torch.stack(out)


def scattered_blocks(count: int, pool_blocks: int, seed: int) -> list[int]:
    return torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(seed))[:count].tolist()


def small_tree() -> DraftTree:
    # root -> 0 -> 2 -> 5, root -> 0 -> 3, root -> 1 -> 4: two branches at the root and at node 0
    return DraftTree([11, 12, 13, 14, 15, 16], [-1, -1, 0, 0, 1, 2])


def mixed_call(block_size: int, head_dim: int, seed: int) -> tuple[torch.Tensor, Pool, list[Seq]]:
    """Ragged sequences in one call: decodes at contexts 1, 15, 16, 17 and 1000, a 5-token chain,
    a token tree and a 24-token prefill chunk, on scattered blocks."""
    heads, kv_heads = 9, 3
    per_seq = -(-1010 // block_size)
    pool = Pool.random(8 * per_seq, block_size, kv_heads, head_dim, seed)
    blocks = [scattered_blocks(per_seq, 8 * per_seq, seed + i) for i in range(8)]
    seqs = [Seq.chain(blocks[0], 0, 1), Seq.chain(blocks[1], 14, 1), Seq.chain(blocks[2], 15, 1),
            Seq.chain(blocks[3], 16, 1), Seq.chain(blocks[4], 999, 1), Seq.chain(blocks[5], 40, 5),
            Seq.tree(blocks[6], 33, small_tree()), Seq.chain(blocks[7], 0, 24)]
    q = torch.randn(sum(len(s.prefix) for s in seqs), heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return q, pool, seqs


# ---- tolerance: float64 references -----------------------------------------------------------


def test_exp_ps_within_one_ulp_and_special_values():
    x = torch.cat([torch.linspace(-87.3, 88.7, 400_001), torch.randn(100_000) * 4, torch.rand(10_000) * 1e-4])
    ref = torch.exp(x.double())
    spacing = (torch.nextafter(ref.float(), torch.tensor(float("inf"))) - ref.float()).double()
    ulps = ((ext.exp_ps(0, x).double() - ref).abs() / spacing).max().item()
    assert ulps <= 1.0, f"exp_ps is {ulps:.2f} ulp off"
    special = torch.tensor([0.0, -0.0, float("-inf"), -88.0, -1e30, 88.8, float("inf"), float("nan")])
    for level in LEVELS:
        got = ext.exp_ps(level, special)
        assert got[:2].tolist() == [1.0, 1.0] and got[2:5].tolist() == [0.0, 0.0, 0.0]
        assert got[5:7].tolist() == [float("inf")] * 2 and got[7].isnan()


def test_rmsnorm_and_silu_mul_match_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 576, generator=g), torch.randn(576, generator=g)
    ref = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * w.double()
    gu = torch.randn(70, 2 * 1536, generator=g) * 6
    gate, up = gu.double().split(1536, dim=-1)
    for level in LEVELS:
        assert (ext.rmsnorm(level, x, w, 1e-5).double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()
        got = ext.silu_mul(level, gu).double()
        assert (got - torch.nn.functional.silu(gate) * up).abs().max().item() <= 1e-6 * got.abs().max().item()


def test_tanh_gelu_and_softcap_match_float64():
    """tanh_ps within a few float32 ulp of 1 (absolute); GeGLU and soft-capping through it."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-12, 12, 200_000), torch.randn(16_000, generator=g) * 1e-3]).reshape(-1, 16)
    gu = torch.randn(70, 2 * 1536, generator=g) * 4
    gate, up = gu.double().split(1536, dim=-1)
    gelu = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
    for level in LEVELS:
        tanh = ext.softcap(level, x, 1.0).double()
        assert (tanh - torch.tanh(x.double())).abs().max().item() <= 3e-7
        capped = ext.softcap(level, x * 40, 30.0).double()
        assert (capped - torch.tanh(x.double() * 40 / 30) * 30).abs().max().item() <= 3e-5
        got = ext.gelu_mul(level, gu).double()
        assert (got - gelu).abs().max().item() <= 1e-6 * gelu.abs().max().item()


@pytest.mark.parametrize("block_size, softcap, window", [(1, 0.0, 0), (16, 0.0, 0), (5, 0.0, 0), (16, 2.0, 0),
                                                         (16, 0.0, 7), (5, 2.0, 3)])
def test_attention_matches_float64(block_size, softcap, window):
    q, pool, seqs = mixed_call(block_size, 64, seed=block_size)
    ref = reference(q, pool, seqs, 0.125, softcap, window)
    for level in LEVELS:
        assert (attend(level, q, pool, seqs, softcap=softcap, window=window).double() - ref).abs().max().item() <= 2e-6


def long_prompt(block_size: int, seed: int, context: int = 300, num_q: int = 150) -> tuple[torch.Tensor, Pool, Seq]:
    """A prompt chunk of num_q tokens after `context` on scattered blocks: many 32-key blocks,
    several 64-row tiles (9 heads on 3 kv heads), pool blocks unaligned to key blocks."""
    per_seq = -(-(context + num_q) // block_size)
    pool = Pool.random(2 * per_seq, block_size, 3, 64, seed)
    seq = Seq.chain(scattered_blocks(per_seq, 2 * per_seq, seed), context, num_q)
    q = torch.randn(num_q, 9, 64, generator=torch.Generator().manual_seed(seed)) * 2
    return q, pool, seq


@pytest.mark.parametrize("block_size, softcap, window", [(16, 0.0, 0), (5, 0.0, 0), (16, 3.0, 0), (7, 0.0, 45),
                                                         (16, 2.0, 100)])
def test_tiled_prompt_attention_matches_float64_at_every_level(block_size, softcap, window):
    """The tiled prompt path over long contexts (hundreds of keys: many key blocks, tiles and
    blocks skipped below a window): within float32 rounding of the float64 softmax, and every
    level's bits the generic level's."""
    q, pool, seq = long_prompt(block_size, seed=block_size + int(softcap) + window)
    ref = reference(q, pool, [seq], 0.125, softcap, window)
    generic = attend(0, q, pool, [seq], softcap=softcap, window=window)
    # Each row sums its hundreds of keys one after another in float32: ~2e-6 of the largest output
    # here, where torch's float32 softmax (summing in blocks) comes within ~6e-7.
    assert (generic.double() - ref).abs().max().item() <= 3e-6 * ref.abs().max().item()
    for level in LEVELS[1:]:
        assert_same_bits(attend(level, q, pool, [seq], softcap=softcap, window=window), generic, f"level {level}")


@pytest.mark.parametrize("softcap, window", [(0.0, 0), (2.0, 0), (0.0, 45)])
def test_a_prompt_in_chunks_gives_the_whole_prompts_bits(softcap, window):
    """The same prompt whole, in chunks cut anywhere (not at tiles or key blocks), token by token
    as decode steps and beside other sequences in one call: each row's blocks are its own."""
    q, pool, seq = long_prompt(16, seed=3)
    for level in LEVELS:
        whole = attend(level, q, pool, [seq], softcap=softcap, window=window)
        cuts = [0, 37, 101, 102, 150]
        parts = [attend(level, q[a:b], pool, [Seq(seq.blocks, seq.prefix[a:b])], softcap=softcap, window=window)
                 for a, b in zip(cuts, cuts[1:])]
        assert_same_bits(torch.cat(parts), whole, f"level {level}, in chunks")
        for i in (0, 31, 32, 149):
            alone = attend(level, q[i:i + 1], pool, [Seq(seq.blocks, seq.prefix[i:i + 1])], softcap=softcap,
                           window=window)
            assert_same_bits(alone, whole[i:i + 1], f"level {level}, token {i} alone")
        partner = Seq.chain([b for b in range(len(seq.blocks) * 2) if b not in seq.blocks], 70, 30)
        qp = torch.randn(30, 9, 64, generator=torch.Generator().manual_seed(9))
        mixed = attend(level, torch.cat([qp, q[60:]]), pool, [partner, Seq(seq.blocks, seq.prefix[60:])],
                       softcap=softcap, window=window)
        assert_same_bits(mixed[30:], whole[60:], f"level {level}, beside another prompt")


# ---- exact: the same bits at every level, whatever shares the call ----------------------------


def half_edge_values() -> torch.Tensor:
    """float32 values where rounding to half is delicate, as bits -> float32 [n]."""
    f = np.float32
    values = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0,
              65519.996,  # just under the halfway point past the largest half: 65504
              65520.0, -65520.0, 1e10, np.inf, -np.inf,  # halfway and beyond: infinity
              2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -12),  # smallest normal half; just below it rounds up to it
              2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * (1 + 2.0 ** -20), 3 * 2.0 ** -25, 5 * 2.0 ** -25,  # subnormal ties
              2.0 ** -26, 1e-45, -1e-45, 2.0 ** -126,  # round to (signed) zero; float subnormals
              1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 1 + 2.0 ** -11 + 2.0 ** -23,  # ties to even, just past a tie
              2049.0, 2051.0, -2051.0, 0.1, -3.14159, 1000.37]
    x = torch.tensor(np.array(values, dtype=f))
    return torch.cat([x, x[:13]])  # 45 values: two vectors and a scalar tail at every level


def test_rounding_to_half_is_round_to_nearest_even_at_every_level():
    """The KV pool's float -> half conversion: numpy's bits (IEEE round to nearest, ties to even,
    subnormal halves, overflow to infinity) at every level, vector body and scalar tail alike;
    a NaN keeps its sign and top payload bits and becomes quiet, as F16C's cvtps_ph makes it."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(4001, generator=g) * torch.exp2(torch.randint(-30, 18, (4001,), generator=g).float())
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC12345 - (1 << 32), 0x7FBFE000], dtype=torch.int32)
    for x in (half_edge_values(), wide):
        with np.errstate(over="ignore"):  # overflowing to infinity is what is tested
            want = torch.from_numpy(x.numpy().astype(np.float16))
        for level in LEVELS:
            got = ext.to_half(level, x)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"level {level}"
            assert torch.equal(got.float()[x.abs() <= 65504], x[x.abs() <= 65504].half().float())
    expected_nan = torch.tensor([0x7E00, 0x7E00, 0xFE09 - (1 << 16), 0x7FFF], dtype=torch.int16)
    for level in LEVELS:
        got = ext.to_half(level, torch.cat([nans.view(torch.float32)] * 5))  # 20: a vector and a tail
        assert torch.equal(got.view(torch.int16), torch.cat([expected_nan] * 5)), f"level {level}"


@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_every_level_gives_the_generic_bits(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    x = torch.randn(70, 8 * head_dim, generator=g) * 3
    w = torch.randn(8 * head_dim, generator=g)
    exp_in = torch.randn(1000, generator=g) * 40
    q, pool, seqs = mixed_call(16 if head_dim != 48 else 3, head_dim, seed=head_dim)
    pos = torch.randint(0, 4096, (70,), generator=g)
    cos, sin = torch.randn(4096, head_dim // 2, generator=g), torch.randn(4096, head_dim // 2, generator=g)
    results = {}
    for level in LEVELS:
        rotated = x.clone()
        ext.rope_(level, rotated, pos, cos, sin, 7, head_dim)  # the last head stays as it is
        results[level] = dict(rmsnorm=ext.rmsnorm(level, x, w, 1e-6), silu_mul=ext.silu_mul(level, x),
                              gelu_mul=ext.gelu_mul(level, x), softcap=ext.softcap(level, x[:, 3:], 2.5),
                              exp_ps=ext.exp_ps(level, exp_in), rope=rotated, attention=attend(level, q, pool, seqs),
                              windowed=attend(level, q, pool, seqs, softcap=4.0, window=5))
    assert torch.equal(results[0]["rope"][:, 7 * head_dim:], x[:, 7 * head_dim:])
    for level in LEVELS[1:]:
        for name, value in results[level].items():
            assert_same_bits(value, results[0][name], f"{name} at level {level}, head_dim {head_dim}")


def test_rope_equals_the_torch_path():
    """x1 c - x2 s and x2 c + x1 s, products rounded: what apply_rope computes with the full tables."""
    g = torch.Generator().manual_seed(1)
    half = 32
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32), torch.rand(half, generator=g))
    cos, sin = freqs.cos(), freqs.sin()
    x = torch.randn(20, 12, 2 * half, generator=g)  # [tokens, heads, head_dim]
    pos = torch.randint(0, 8192, (20,), generator=g)
    full_cos, full_sin = torch.cat([cos, cos], -1)[pos], torch.cat([-sin, sin], -1)[pos]
    want = apply_rope(x[None], full_cos[None, :, None], full_sin[None, :, None])[0]
    for level in LEVELS:
        got = x.clone()
        ext.rope_(level, got, pos, cos, sin, 12, 2 * half)
        assert_same_bits(got, want, f"rope at level {level}")


@pytest.mark.parametrize("context, window", [(1, 0), (16, 0), (17, 0), (1000, 0), (17, 9), (1000, 9)])
def test_attention_output_does_not_depend_on_the_rest_of_the_call(context, window):
    """A decode query alone; as the first token of 1..17 verification tokens; beside other
    sequences (chains, a tree, other lengths); with different partners: the same bits (through
    a sliding window too, where each query's window starts elsewhere)."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    pool = Pool.random(400, block_size, kv_heads, head_dim, seed=context)
    mine = scattered_blocks(-(-(context + 17) // block_size), 200, seed=context)
    others = [scattered_blocks(70, 400, seed=context + i)[:70] for i in range(3)]
    others = [[b for b in o if b not in mine][:65] for o in others]
    g = torch.Generator().manual_seed(context)
    q = torch.randn(17, heads, head_dim, generator=g)
    partners = [Seq.chain(others[0], 700, 9), Seq.tree(others[1], 12, small_tree()), Seq.chain(others[2], 3, 1)]
    qp = [torch.randn(len(s.prefix), heads, head_dim, generator=g) for s in partners]
    for level in LEVELS:
        alone = attend(level, q[:1], pool, [Seq.chain(mine, context - 1, 1)], window=window)
        last_alone = attend(level, q[16:], pool, [Seq([*mine], [context + 16])], window=window)
        for width in range(1, 18):
            got = attend(level, q[:width], pool, [Seq.chain(mine, context - 1, width)], window=window)
            assert_same_bits(got[:1], alone, f"level {level}, first of {width} tokens")
        assert_same_bits(got[16:], last_alone, f"level {level}, last of 17 tokens")
        for chosen in ([0], [1], [0, 2], [2, 1, 0]):
            seqs = [partners[i] for i in chosen]
            lead = sum(len(s.prefix) for s in seqs[:1])
            call = seqs[:1] + [Seq.chain(mine, context - 1, 1)] + seqs[1:]
            qs = torch.cat([qp[chosen[0]], q[:1], *[qp[i] for i in chosen[1:]]])
            got = attend(level, qs, pool, call, window=window)
            assert_same_bits(got[lead:lead + 1], alone, f"level {level}, beside partners {chosen}")


@pytest.mark.parametrize("window", [0, 3, 40])
def test_tree_query_equals_the_chain_query_of_its_accepted_path(window):
    """Node 5 of the tree (path root -> 0 -> 2 -> 5) sees the context, the root and its ancestors;
    after compaction its path sits right after the root, where a chain query sees the same keys in
    the same order at other slots. Through a window of 3 it sees its path alone, not the root: a
    window counts the ancestors' positions, not their slots."""
    heads, kv_heads, head_dim, block_size, start = 9, 3, 64, 16, 300
    tree = small_tree()
    path = [0, 2, 5]
    pool = Pool.random(64, block_size, kv_heads, head_dim, seed=5)
    tree_seq = Seq.tree(scattered_blocks(21, 32, seed=1), start, tree)
    chain_seq = Seq(scattered_blocks(21, 32, seed=2), [start + 1 + len(path)])
    chain_seq.blocks = [b + 32 for b in chain_seq.blocks]  # the other half of the pool
    for p in range(start + 1):  # the same context and root
        pool.k[pool.slot(chain_seq, p)] = pool.k[pool.slot(tree_seq, p)]
        pool.v[pool.slot(chain_seq, p)] = pool.v[pool.slot(tree_seq, p)]
    for depth, node in enumerate(path):  # the accepted path, compacted
        dst, src = pool.slot(chain_seq, start + 1 + depth), pool.slot(tree_seq, start + 1 + node)
        pool.k[dst], pool.v[dst] = pool.k[src], pool.v[src]
    q = torch.randn(tree.num_nodes + 1, heads, head_dim, generator=torch.Generator().manual_seed(6))
    for level in LEVELS:
        in_tree = attend(level, q, pool, [tree_seq], window=window)[1 + path[-1]]
        as_chain = attend(level, q[1 + path[-1]:2 + path[-1]], pool, [chain_seq], window=window)[0]
        assert_same_bits(in_tree, as_chain, f"level {level}")


def binary_tree(nodes: int) -> DraftTree:
    """Two children a node, breadth first: node i's parent is (i - 2) // 2."""
    return DraftTree(list(range(100, 100 + nodes)), [-1 if i < 2 else (i - 2) // 2 for i in range(nodes)])


@pytest.mark.parametrize("start", [5, 31, 32, 33, 300])
def test_verification_trees_give_the_generic_bits_alone_and_beside_others(start):
    """Trees of 1, 6 and 25 nodes (6 to 78 rows a kv head: a row-by-row tile, a lane tile, two
    tiles cut between tokens) after contexts below, at and past key-block edges, where the keys
    every token sees are taken once for all of them: every level gives the generic level's
    bits, on one thread and on two, alone and beside a prompt chunk and a decode (which keep
    their own bits as chains), soft-capped too; within float32 rounding of the float64 softmax."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    pool = Pool.random(160, block_size, kv_heads, head_dim, seed=start)
    mine, chunk, decode = (scattered_blocks(160, 160, seed=start)[i::3] for i in range(3))
    g = torch.Generator().manual_seed(start)
    before = torch.get_num_threads()
    try:
        for nodes in (1, 6, 25):
            tree = Seq.tree(mine, start, binary_tree(nodes))
            partners = [Seq.chain(chunk, 40, 24), Seq.chain(decode, 700, 1)]
            q = torch.randn(nodes + 1 + 25, heads, head_dim, generator=g)
            ref = reference(q[:nodes + 1], pool, [tree], 0.125)
            for softcap in (0.0, 2.0):
                torch.set_num_threads(1)
                want = attend(0, q[:nodes + 1], pool, [tree], softcap=softcap)
                want_partners = attend(0, q[nodes + 1:], pool, partners, softcap=softcap)
                if not softcap:
                    assert (want.double() - ref).abs().max().item() <= 2e-6
                for level in LEVELS:
                    for threads in (1, 2):
                        torch.set_num_threads(threads)
                        what = f"level {level}, {threads} threads, {nodes} nodes, softcap {softcap}"
                        assert_same_bits(attend(level, q[:nodes + 1], pool, [tree], softcap=softcap), want, what)
                        both = attend(level, q, pool, [tree] + partners, softcap=softcap)
                        assert_same_bits(both[:nodes + 1], want, what + ", beside others")
                        assert_same_bits(both[nodes + 1:], want_partners, what + ", the others")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("window", [0, 40])
def test_attention_bits_do_not_depend_on_the_thread_count(window):
    """Decode and verification calls have few tasks (one per kv head), which more than one thread
    take as shares of their rows, cut inside a task and inside a token's heads: each row gives
    the bits it gives on one thread, for chains, a tree and two sequences, at every level."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    pool = Pool.random(200, block_size, kv_heads, head_dim, seed=11)
    mine, other = scattered_blocks(40, 100, seed=11), scattered_blocks(40, 100, seed=12)
    other = [b + 100 for b in other]
    g = torch.Generator().manual_seed(11)
    calls = [[Seq.chain(mine, 299, width)] for width in (1, 2, 3, 5, 9)]
    calls += [[Seq.tree(mine, 300, small_tree())], [Seq.chain(mine, 299, 2), Seq.chain(other, 400, 3)]]
    before = torch.get_num_threads()
    try:
        for seqs in calls:
            q = torch.randn(sum(len(s.prefix) for s in seqs), heads, head_dim, generator=g)
            for level in LEVELS:
                torch.set_num_threads(1)
                one = attend(level, q, pool, seqs, window=window)
                for threads in (2, 3, 4):
                    torch.set_num_threads(threads)
                    got = attend(level, q, pool, seqs, window=window)
                    assert_same_bits(got, one, f"level {level}, {threads} threads, {len(q)} rows")
    finally:
        torch.set_num_threads(before)


def test_bad_inputs_are_refused_with_a_reason():
    pool = Pool.random(4, 16, 3, 64, seed=0)
    q = torch.randn(2, 9, 64)
    call = dict(q_start=torch.tensor([0, 2]), block_table=torch.tensor([[0, 1]]), prefix_len=torch.tensor([5, 6]))
    assert attend(0, q, pool, [Seq([0, 1], [5, 6])]).shape == (2, 9 * 64)
    for level in LEVELS:  # a query that sees no slot
        assert not attend(level, q[:1], pool, [Seq([0], [0])]).any()
    with pytest.raises(RuntimeError, match="lies outside"):
        ext.paged_attention(0, q, pool.k, pool.v, **(call | dict(prefix_len=torch.tensor([5, 33]))))
    with pytest.raises(RuntimeError, match="is not a block of the pool"):
        ext.paged_attention(0, q, pool.k, pool.v, **(call | dict(block_table=torch.tensor([[0, 9]]), prefix_len=torch.tensor([5, 17]))))
    with pytest.raises(RuntimeError, match="come together"):
        ext.paged_attention(0, q, pool.k, pool.v, **call, tree_row=torch.tensor([-1, -1]))
    with pytest.raises(RuntimeError, match="cannot share"):
        ext.paged_attention(0, torch.randn(2, 8, 64), pool.k, pool.v, **call)
    with pytest.raises(RuntimeError, match="must be contiguous float16"):
        ext.paged_attention(0, q, pool.k.float(), pool.v.float(), **call)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.rmsnorm(0, torch.randn(2, 40), torch.ones(40), 1e-6)
    with pytest.raises(RuntimeError, match="positions must lie"):
        ext.rope_(0, torch.randn(2, 64), torch.tensor([0, 8]), torch.ones(8, 32), torch.ones(8, 32), 1, 64)
