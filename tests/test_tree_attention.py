"""Token trees through the paged cache: positions, slots and masks on a hand-built tree; a tree
pass gives every node the logits of its path run as a chain; the accepted path's entries, moved
down after the root, serve the next step as if the path had been computed as a chain."""

from __future__ import annotations

import torch

from specserve.model.runner import ForwardBatch, ModelRunner
from tests.paged_reference import PagedReferenceCache
from specserve.drafts.tree import DraftTree

TREE = DraftTree([11, 12, 13, 14, 15], [-1, -1, 0, 0, 1])  # depths 1 1 2 2 2


def test_tree_metadata_positions_slots_and_mask():
    cache = PagedReferenceCache(1, 8, 4, 1, 2, torch.float32, "cpu")
    tables = [[3, 5, 6], [1, 2]]
    meta = cache.metadata(tables, [5, 2], [6, 3], [TREE.attention_mask(), None])
    assert meta.positions.tolist() == [[5, 6, 6, 7, 7, 7], [2, 3, 4, 0, 0, 0]]
    # Slots stay linear: token j of the tree at position 5 + j, i.e. block 5 offset 1, ...
    slots = [5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2]
    trash = cache.trash_block * 4
    assert meta.write_index.tolist() == slots + [1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0, trash, trash, trash]
    visible = meta.mask[:, 0] == 0  # [B, T, S]
    assert meta.context_len == 11
    for j in range(6):
        assert visible[0, j, :5].all()  # the committed context
        assert torch.equal(visible[0, j, 5:], TREE.attention_mask()[j])  # then its ancestors and itself
    assert visible[1, :3, :5].tolist() == [[k <= p for k in range(5)] for p in (2, 3, 4)]  # causal row


def _dense_logits(model, ids: list[int]) -> torch.Tensor:
    """Reference: one causal pass over ids on a fresh dense cache -> [len(ids), V]."""
    runner = ModelRunner.dense(model, 1, 128)
    return runner.execute(ForwardBatch([0], [0], [ids], all_logits=True))[0]


def test_tree_pass_equals_each_path_as_a_chain_and_compaction_serves_the_next_step(tiny):
    model = tiny["loaded"].model
    prompts = [[5, 9, 2, 7, 7, 3, 8, 4, 6, 10, 12, 1, 3], [4, 4, 8, 2, 9]]
    runner = ModelRunner.paged(model, 16, 4)
    tables = [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11]]
    # Prefill all but each prompt's last token, which becomes the root.
    runner.execute(ForwardBatch(tables, [0, 0], [p[:-1] for p in prompts], all_logits=True))
    starts = [len(p) - 1 for p in prompts]
    chain = [21, 22]  # the second request verifies a plain chain in the same pass
    logits = runner.execute(ForwardBatch(tables, starts, [[prompts[0][-1]] + TREE.token_ids, [prompts[1][-1]] + chain],
                                         all_logits=True, tree_masks=[TREE.attention_mask(), None]))
    for path in TREE.paths():
        ref = _dense_logits(model, prompts[0] + [TREE.token_ids[c] for c in path])[starts[0]:]  # [1 + len(path), V]
        torch.testing.assert_close(logits[0, [0] + [c + 1 for c in path]], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1, :3], _dense_logits(model, prompts[1] + chain)[starts[1]:], atol=1e-5, rtol=1e-5)

    # Accept the path of nodes 1, 4 (not in place: they sit at slots start + 2 and start + 5).
    path = [1, 4]
    s = starts[0]
    runner.cache.move([tables[0]], [[s + 1 + n for n in path]], [[s + 1, s + 2]])
    accepted = [TREE.token_ids[n] for n in path]
    nxt = 30
    step = runner.execute(ForwardBatch([tables[0]], [s + 1 + len(path)], [[nxt]], all_logits=True))
    ref = _dense_logits(model, prompts[0] + accepted + [nxt])[-1]
    torch.testing.assert_close(step[0, 0], ref, atol=1e-5, rtol=1e-5)
