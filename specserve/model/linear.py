"""Linear layers with a fused residual add, and a CPU version whose weight is prepacked for oneDNN.

`Linear` is `nn.Linear` plus `forward_add` (x W^T + b + residual) and runs on any device.
`PackedLinear` holds its weight only in oneDNN's blocked layout, reordered once at load time,
and runs the product and the residual add in one call. Measured (all 120 layer matrices of the
embedded model, medians; specserve.bench.forward measures whole steps):

    rows (query tokens)              1      2      4/5    8
    Intel Xeon (AMX), 2 cores
      bfloat16  F.linear          18.6   18.6   18.3   18.4 ms
      bfloat16  PackedLinear      12.1   11.8   11.8   12.1 ms   (AMX kernels, no per-call reorder)
      float32   F.linear          17.3   18.0   29.4   35.4 ms   (MKL: a gemv at 1 row)
      float32   PackedLinear      21.5   22.4   21.7   25.6 ms
    AMD EPYC (AVX-512), 2 cores
      float32   F.linear          27.8   56.9   37.9   33.7 ms
      float32   PackedLinear      16.4   17.2   14.4   17.0 ms
    float32 lm_head F.linear       4.3    4.5    9.2   13.8 ms   (49152 x 576, Intel)
    float32 lm_head packed         4.3    4.5    4.3    5.3 ms

Packed kernels cost about the same for 1 to 8 rows, which is what makes a k+1-token
verification pass nearly as cheap as a 1-token decode step; MKL's gemm at 2+ rows costs up to
twice its 1-row gemv. So every dtype is packed (float32 gives up ~20% at one row on the Intel
machine and gains 40% on the AMD one).

One packed copy serves every row count: the layout does not depend on it, and results agree with
F.linear to rounding for 1..64 rows. A call costs ~13 us of oneDNN overhead, which the larger
matrices repay many times over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Row count oneDNN is told to expect when it picks the blocked layout. Every value from 2 up
# gives the same layout (AB16b64a in float32, AB16b32a2b in bfloat16); 1 keeps the plain
# layout, whose kernels are slower at every row count.
_PACK_ROWS_HINT = 4


class Linear(nn.Linear):
    """nn.Linear with a residual add; the reference every device runs."""

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x: [..., in], residual: [..., out] -> residual + x W^T + b."""
        return residual + F.linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    """A CPU linear layer whose weight [out, in] lives in oneDNN's blocked layout.

    The packed weight is an opaque oneDNN tensor, not a Parameter: an execution detail of this
    CPU, built after loading, never saved or moved between devices.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_ROWS_HINT)
        self.bias = linear.bias
        if keep_weight:  # shared with another user (a tied embedding), so it stays in memory anyway
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


def pack_linears(module: nn.Module) -> None:
    """Replace every nn.Linear inside `module` by a PackedLinear, dropping the plain weight."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))


class NativeLinear(nn.Module):
    """A linear layer on specserve's native kernels: its weight quantized to Q8_0 blocks at
    build time, activations to int8 per 32-element block at each call (as the native model's
    products). For drafter heads next to a native target: they read half the bytes of
    bfloat16, and their outputs only choose draft candidates, which the target verifies."""

    def __init__(self, linear: nn.Linear, ext, level: int):
        super().__init__()
        from gguf import GGMLQuantizationType

        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.ext, self.level = ext, level
        self.format = int(GGMLQuantizationType.Q8_0)
        rows = -(-self.out_features // 16) * 16  # the kernels take whole 16-row units
        weight = torch.zeros(rows, self.in_features)
        weight[: self.out_features] = linear.weight.detach().float()
        self.rows = rows
        self.units = ext.repack(self.format, ext.quantize_weight(self.format, weight), self.in_features)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def _apply_kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        res = None if residual is None else residual.reshape(-1, self.out_features).float().contiguous()
        y = self.ext.qgemm(self.level, self.format, self.units, self.out_features, flat, self.bias, res)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(x, None)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(x, residual)


def quantize_linears(module: nn.Module, ext, level: int) -> None:
    """Replace every nn.Linear inside `module` by a NativeLinear (Q8_0), in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, NativeLinear(child, ext, level))
