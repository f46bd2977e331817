"""Micro-benchmark of one quantized product on the native kernels: y [T, rows] = x [T, cols] W^T.

Where bench.forward times whole passes, this times the product alone, so that a verification
pass's cost can be taken apart: T = 1 reads the weight and is bound by memory; T = 9 or 17 does
T times the integer products per byte read and is bound by the multiply ports. Two settings of
the same product show which bound holds:

- `--copies 1` keeps one weight hot in the caches (a 2048 x 8192 Q4_0 matrix is 9.4 MB: in L3),
  so the time is the kernel's arithmetic alone;
- `--copies N` cycles through N copies (N x the size, past the last-level cache), so each
  product streams its weight from memory as a model's pass does.

Reported per size: ms per product, GMAC/s (rows x cols x T multiply-adds), the weight's GB/s,
the ratio to the first size, and CPU cycles per 16 rows x 32 elements x one activation row (a
unit-row: 16 VNNI vpdpbusd lanes of 4 products, 8 instructions at AVX-512) when --ghz is
given: a kernel whose every unit-row costs 8 multiply-port instructions of dot products and 2
of its float epilogue can reach 10 cycles at best where the 512-bit multiply issues once a cycle.

    python -m specserve.bench.qgemm [--format q4_0] [--rows 8192] [--cols 2048] [--sizes 1 9 17]
        [--copies 1 16] [--threads 2] [--ghz 3.6]
    python -m specserve.bench.qgemm --gguf FILE --tensor blk.0.ffn_gate.weight   # a file's own blocks

--format makes a random [rows, cols] weight in q4_0, q4_1 or q8_0; --gguf takes a tensor's blocks
as a file holds them, so that every type the kernels compute on (K-quants from llama.cpp's
`llama-quantize`, Q5_0, IQ4_NL...) can be measured.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from specserve.hardware import machine, native_level
from specserve.model import hugepages
from specserve.model.hugepages import HugeArena
from specserve.model.native_llama import QUANT_FORMATS, Blocks, as_blocks


def product_times(ext, level: int, fmt: int, units: list[torch.Tensor], rows: int, cols: int,
                  sizes: list[int], rounds: int) -> dict[int, float]:
    """Median seconds of one product per size in `sizes`, cycling through `units` (interleaved
    sizes, round after round; round 0 warms up)."""
    g = torch.Generator().manual_seed(1)
    xs = {t: torch.randn(t, cols, generator=g) for t in sizes}
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for r in range(rounds + 1):
        for t in sizes:
            start = time.perf_counter()
            for u in units:
                ext.qgemm(level, fmt, u, rows, xs[t])
            if r:
                times[t].append((time.perf_counter() - start) / len(units))
    return {t: statistics.median(v) for t, v in times.items()}


def file_blocks(path: str, tensor: str, ext) -> Blocks:
    """A 2-D tensor's blocks as the GGUF file holds them (ValueError: no such tensor, or one the
    kernels do not compute on)."""
    from specserve.model.gguf_loader import open_gguf, tensor_blocks

    reader = open_gguf(Path(path))
    found = next((t for t in reader.tensors if t.name == tensor), None)
    if found is None or len(found.shape) != 2:
        names = [t.name for t in reader.tensors if len(t.shape) == 2]
        raise ValueError(f"{path} has no 2-D tensor {tensor!r}; it has {', '.join(names[:8])}"
                         + (", ..." if len(names) > 8 else ""))
    blocks = tensor_blocks(found)
    if not blocks.on_kernels(ext) or blocks.rows % 16:
        raise ValueError(f"{tensor} is {blocks.format.name} [{blocks.rows} x {blocks.cols}]: not a format and shape "
                         "the native kernels compute on")
    return blocks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=sorted(set(QUANT_FORMATS) - {"int8", "int4"}), default="q4_0")
    ap.add_argument("--rows", type=int, default=8192, help="weight rows (output features; a multiple of 16)")
    ap.add_argument("--cols", type=int, default=2048, help="weight columns (input features; a multiple of 32)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 9, 17], help="activation rows T")
    ap.add_argument("--copies", type=int, nargs="+", default=[1, 16],
                    help="weights cycled through: 1 stays in cache, many stream from memory")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--ghz", type=float, default=None, help="the cores' clock, for cycles per unit-row")
    ap.add_argument("--gguf", default=None, help="take the weight from this GGUF file (--tensor) instead")
    ap.add_argument("--tensor", default="blk.0.ffn_gate.weight", help="--gguf: the tensor's name in the file")
    args = ap.parse_args(argv)
    if args.rows % 16 or args.cols % 32 or min(args.sizes) < 1 or min(args.copies) < 1:
        ap.error("--rows must be a multiple of 16, --cols of 32, --sizes and --copies at least 1")
    from specserve import native

    ext = native.load()
    if ext is None:
        ap.error(f"the native kernels are not available: {native.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gguf:
        try:
            blocks = file_blocks(args.gguf, args.tensor, ext)
        except (OSError, ValueError) as e:
            ap.error(str(e))
        args.rows, args.cols, name = blocks.rows, blocks.cols, f"{args.tensor} {blocks.format.name}"
    else:
        dense = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0)) * 0.02
        blocks, name = as_blocks(dense, QUANT_FORMATS[args.format], True, ext), args.format
    fmt, raw = blocks.format, torch.from_numpy(np.ascontiguousarray(blocks.raw))
    level = int(native_level())
    threads = torch.get_num_threads()
    print(f"# {machine().describe()}, {hugepages.describe()}, {threads} threads, {name} [{args.rows} x {args.cols}], "
          f"median of {args.rounds} rounds")
    print(f"{'copies':>7}{'MB':>8}{'T':>5}{'ms':>10}{'GMAC/s':>9}{'GB/s':>8}{'ratio':>7}"
          + (f"{'cyc/unit-row':>14}" if args.ghz else ""))
    for copies in args.copies:
        arena = HugeArena()  # where the engine keeps its units (model/hugepages.py)
        units = [arena.hold(ext.repack(int(fmt), raw, args.cols)) for _ in range(copies)]
        nbytes = units[0].numel()
        med = product_times(ext, level, int(fmt), units, args.rows, args.cols, args.sizes, args.rounds)
        first = med[args.sizes[0]]
        for t in args.sizes:
            s = med[t]
            line = (f"{copies:>7}{copies * nbytes / 1e6:>8.1f}{t:>5}{s * 1e3:>10.3f}"
                    f"{args.rows * args.cols * t / s / 1e9:>9.1f}{nbytes / s / 1e9:>8.1f}{s / first:>7.2f}")
            if args.ghz:  # unit-rows per thread: (rows / 16) x (cols / 32) x T / threads
                unit_rows = args.rows / 16 * args.cols / 32 * t / threads
                line += f"{s * args.ghz * 1e9 / unit_rows:>14.1f}"
            print(line, flush=True)
        del units


if __name__ == "__main__":
    main()
