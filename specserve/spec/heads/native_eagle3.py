"""The EAGLE-3 drafter on specserve's native kernels: one C++ call per drafting depth
(specserve/native/csrc/eagle3.cpp) computes Eagle3Head's arithmetic (eagle3.py) and its logits.

Its matrices are quantized from the torch module's float weights (Q8_0 unless asked otherwise)
and computed on by the target's kernels, at the target's CPU level: activations quantized to
int8 per 32-element block before each product, keys and values kept as halves in the drafter's
own one-layer paged cache. Every kernel computes a token's row from that token's inputs alone,
so a drafted row never depends on which other rows share the call.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specserve.errors import ModelLoadError
from specserve.model.hugepages import HugeArena
from specserve.model.native_llama import Blocks, as_blocks, kernel_formats
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import Eagle3Config

_UNIT_ROWS = 16  # the kernels' weight rows per unit: lm_head's rows are padded to it


class NativeEagle3Drafter:
    """step(embeds, feature, ...) -> (out, logits): one drafting depth for n flattened tokens.

    Shapes (H the drafter's hidden size, Ht the target's, Vd the draft vocabulary):
      embeds    float32 [n, H]        the drafted-from tokens' embeddings (the target's table)
      feature   float32 [n, 3 Ht]     the target's captured states (depth 1: fc fuses them)
             or float32 [n, H]        the previous depth's `out`
      out       float32 [n, H]        the layer's output before the final norm: the next feature
      logits    float32 [n, Vd]       over the draft vocabulary (rows map to target ids by draft_ids)
    The cache is the drafter's own: k_cache, v_cache float16 [1, rows, kv_heads, head_dim]
    (`cache_shape`), rows in blocks of block_size. The metadata is the native target's
    (layer_ops.h's AttentionBatch; FlatBatch's fields), plus kv_start.
    """

    def __init__(self, core, config: Eagle3Config, matrices: dict[str, object], ext: ModuleType, level: int,
                 draft_ids: torch.Tensor):
        self.core = core  # ext.NativeEagle3
        self.config = config
        self.matrices = matrices  # canonical name -> ext.QMatrix (lm_head's rows padded to 16)
        self.ext = ext
        self.level = level
        self.draft_ids = draft_ids  # [Vd] int64: the target id of each draft row
        self.weight_bytes = sum(m.units.numel() for m in matrices.values())  # what a step reads

    @classmethod
    def from_head(cls, head: Eagle3Head, ext: ModuleType, level: int,
                  fmt: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> NativeEagle3Drafter:
        """Pack `head`'s float weights: matrices quantized to `fmt` (a format the kernels
        compute on), norms float32, RoPE tables from head.rotary (its positions)."""
        cfg = head.config
        kernels = kernel_formats(ext)
        if fmt not in kernels:
            raise ModelLoadError(f"EAGLE-3 drafter: no native kernel computes on {fmt.name}")
        params = dict(head.named_parameters())
        matrices = {}
        arena = HugeArena()  # each drafting depth streams the head and the layer (model/hugepages.py)
        for name in ("fc.weight", "layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight",
                     "layer.o_proj.weight", "layer.gate_proj.weight", "layer.up_proj.weight",
                     "layer.down_proj.weight", "lm_head.weight"):
            b = as_blocks(params[name].detach().float().contiguous(), fmt, True, ext)
            if name == "lm_head.weight":
                b = _padded_rows(b)
            elif b.rows % _UNIT_ROWS:
                raise ModelLoadError(f"EAGLE-3 drafter: {name} has {b.rows} rows; the native kernels need a "
                                     f"multiple of {_UNIT_ROWS}")
            units = arena.hold(ext.repack(int(b.format), torch.from_numpy(b.raw), b.cols))
            matrices[name] = ext.QMatrix(int(b.format), units, b.rows, b.cols)

        def vector(name: str) -> torch.Tensor:
            return params[name].detach().float().reshape(-1).contiguous()

        def stacked(*names: str):
            return ext.Stacked([matrices[f"layer.{n}.weight"] for n in names])

        half = cfg.head_dim // 2  # cos is [c, c] and sin [-s, s]: the kernels take one half of each
        core = ext.NativeEagle3(
            hidden=cfg.hidden_size, target_hidden=cfg.target_hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            eps=cfg.rms_norm_eps, norm_before_residual=cfg.norm_before_residual, fc=matrices["fc.weight"],
            input_norm=vector("layer.input_layernorm.weight"), hidden_norm=vector("layer.hidden_norm.weight"),
            qkv=stacked("q_proj", "k_proj", "v_proj"), o=stacked("o_proj"),
            post_norm=vector("layer.post_attention_layernorm.weight"), gate_up=stacked("gate_proj", "up_proj"),
            down=stacked("down_proj"), final_norm=vector("norm.weight"), lm_head=matrices["lm_head.weight"],
            vocab=cfg.draft_vocab_size, cos=head.rotary.cos[:, :half].float().contiguous(),
            sin=head.rotary.sin[:, half:].float().contiguous())
        return cls(core, cfg, matrices, ext, level, head.draft_ids.clone())

    def cache_shape(self, rows: int) -> tuple[int, int, int, int]:
        """The drafter's K (and V) cache of `rows` slots: float16 [1, rows, kv_heads, head_dim]."""
        return (1, rows, self.config.num_kv_heads, self.config.head_dim)

    def dequantized(self) -> dict[str, torch.Tensor]:
        """Canonical name -> float32 matrix as the products use it ([rows, cols], lm_head
        without its padding rows): the torch reference's weights for the tests."""
        out = {}
        for name, m in self.matrices.items():
            dense = self.ext.dequantize_units(m.format, m.units, m.rows, m.cols)
            out[name] = dense[: self.config.draft_vocab_size] if name == "lm_head.weight" else dense
        return out

    def step(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int, q_start: torch.Tensor,
             block_table: torch.Tensor, prefix_len: torch.Tensor, kv_start: torch.Tensor | None = None,
             tree_row: torch.Tensor | None = None, tree_start: torch.Tensor | None = None,
             tree_size: torch.Tensor | None = None,
             tree_mask: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting depth -> (out float32 [n, H], logits float32 [n, Vd]); the GIL is released.
        last_only (no tree): every token writes its key and value, and only each sequence's last
        one goes on -> out [num_seqs, H], logits [num_seqs, Vd], the same bits as those rows of
        the full call.

        embeds [n, H], feature [n, H] or [n, 3 Ht] (contiguous float32); positions, slots,
        prefix_len int64 [n]: each token's RoPE position, the cache row its key and value go to,
        and how many of its sequence's slots it sees; q_start int64 [num_seqs + 1]; block_table
        int64 [num_seqs, blocks]; kv_start int64 [num_seqs] or None: the first slot each
        sequence's tokens see (a prefix-cache hit starts the drafter's entries late; the slots
        before were never written); tree_row [n], tree_start, tree_size [num_seqs], tree_mask
        uint8: a token tree's ancestors (FlatBatch's fields)."""
        return self.core.forward(self.level, embeds, feature, positions, slots, k_cache, v_cache, block_size,
                                 q_start, block_table, prefix_len, kv_start, tree_row, tree_start, tree_size,
                                 tree_mask, last_only)


def _padded_rows(b: Blocks) -> Blocks:
    """`b` with zero rows appended up to a multiple of 16 (their logits are dropped)."""
    padded = -(-b.rows // _UNIT_ROWS) * _UNIT_ROWS
    if padded == b.rows:
        return b
    pad = np.zeros((padded - b.rows, b.raw.shape[1]), dtype=np.uint8)
    return Blocks(b.format, np.concatenate([b.raw, pad]), padded, b.cols)
