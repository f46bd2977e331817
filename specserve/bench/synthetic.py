"""Random-weight GGUF files of the shapes users run, for the kernel benchmarks.

    python -m specserve.bench.synthetic --shape smollm2-1.7b --out smollm2-1.7b-f16.gguf
    llama-quantize smollm2-1.7b-f16.gguf smollm2-1.7b-q4_k_m.gguf Q4_K_M     # llama.cpp's tool
    python -m specserve.bench.forward --model smollm2-1.7b-q4_k_m.gguf --paths gguf --peer llama.cpp

A pass's cost depends on the matrices' shapes and formats, not on the values in them, so a file
with the published configuration of a model (its hidden size, layers, heads, FFN width, vocabulary,
tied or untied head, RoPE) and random weights measures what the real model would, without
downloading anything. Weights are F16 (or F32) normal(0, 0.02) with unit norms, written tensor by
tensor (a 7B file never sits in memory whole), under llama.cpp's tensor names and keys, so that
both specserve and llama.cpp's tools load it; its vocabulary is GPT-2's 256 byte tokens and filler
tokens (text tokenizes byte by byte: a benchmark's prompts are token ids anyway).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's published configuration, as far as a pass's cost goes."""

    arch: str  # GGUF architecture
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    qkv_bias: bool = False
    llama3_rope: bool = False  # Llama 3.1/3.2's scaled frequencies (factor 32, low 1, high 4, 8192)
    head_dim: int | None = None
    context: int = 8192

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def num_parameters(self) -> int:
        d = self.dim
        per_layer = self.hidden * d * (self.heads * 2 + self.kv_heads * 2) + 3 * self.hidden * self.ffn
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


# From each model's config.json on the Hugging Face Hub.
SHAPES: dict[str, Shape] = {
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 8192, 49152, True, 130000.0),
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, True, 500000.0, llama3_rope=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, True, 500000.0, llama3_rope=True),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 1000000.0, qkv_bias=True),
}



def _byte_tokens() -> list[str]:
    """GPT-2's 256 byte-level token strings (bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, n = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + n))
            n += 1
    return out


def llama3_rope_divisors(shape: Shape, factor: float = 32.0, low: float = 1.0, high: float = 4.0,
                         original: int = 8192) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for Llama 3.1+: [head_dim / 2] divisors."""
    d = shape.dim
    freqs = 1.0 / shape.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensor names -> numpy shapes ([out, in] for matrices), in file order."""
    h, d = shape.hidden, shape.dim
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (shape.vocab, h)}
    if shape.llama3_rope:
        out["rope_freqs.weight"] = (d // 2,)
    for i in range(shape.layers):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (h,)
        out[b + "attn_q.weight"] = (shape.heads * d, h)
        out[b + "attn_k.weight"] = (shape.kv_heads * d, h)
        out[b + "attn_v.weight"] = (shape.kv_heads * d, h)
        if shape.qkv_bias:
            out[b + "attn_q.bias"] = (shape.heads * d,)
            out[b + "attn_k.bias"] = (shape.kv_heads * d,)
            out[b + "attn_v.bias"] = (shape.kv_heads * d,)
        out[b + "attn_output.weight"] = (h, shape.heads * d)
        out[b + "ffn_norm.weight"] = (h,)
        out[b + "ffn_gate.weight"] = (shape.ffn, h)
        out[b + "ffn_up.weight"] = (shape.ffn, h)
        out[b + "ffn_down.weight"] = (h, shape.ffn)
    out["output_norm.weight"] = (h,)
    if not shape.tied:
        out["output.weight"] = (shape.vocab, h)
    return out


def write_synthetic_gguf(shape: Shape, path: str | Path, dtype: str = "f16", seed: int = 0, name: str = "synthetic") -> Path:
    """Write `shape` with random weights to `path` (matrices in `dtype`, f16 or f32; norms,
    biases and rope_freqs float32, as llama.cpp's converter keeps them)."""
    import gguf

    if dtype not in ("f16", "f32"):
        raise ValueError(f"dtype must be f16 or f32, got {dtype!r}")
    path = Path(path)
    matrix_dtype = np.float16 if dtype == "f16" else np.float32
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(name)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.ffn)
    w.add_block_count(shape.layers)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.dim)
    w.add_value_length(shape.dim)
    w.add_rope_dimension_count(shape.dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    # GPT-2's byte tokens, filler tokens, and one merge ("t" + "0"), which llama.cpp's BPE
    # vocabulary requires to exist; special ids at the end.
    tokens = _byte_tokens()
    tokens += [f"t{i}" for i in range(shape.vocab - len(tokens) - 2)] + ["<|bos|>", "<|eos|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (shape.vocab - 2) + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(shape.vocab - 2)
    w.add_eos_token_id(shape.vocab - 1)
    rng = np.random.default_rng(seed)

    def make(name: str, dims: tuple[int, ...]) -> np.ndarray:
        if name == "rope_freqs.weight":
            return llama3_rope_divisors(shape)
        if len(dims) == 1:
            return (np.ones(dims, np.float32) if name.endswith("norm.weight")
                    else (0.02 * rng.standard_normal(dims, dtype=np.float32)))
        return (0.02 * rng.standard_normal(dims, dtype=np.float32)).astype(matrix_dtype)

    shapes = tensor_shapes(shape)
    for tname, dims in shapes.items():
        dt = np.dtype(matrix_dtype if len(dims) == 2 else np.float32)
        w.add_tensor_info(tname, dims, dt, int(np.prod(dims)) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, dims in shapes.items():
        w.write_tensor_data(make(tname, dims))
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES), help="published configuration to copy")
    ap.add_argument("--out", required=True, help="the .gguf file to write")
    ap.add_argument("--dtype", default="f16", choices=["f16", "f32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    out = write_synthetic_gguf(shape, args.out, args.dtype, args.seed, name=f"{args.shape} (random weights)")
    print(f"wrote {out}: {args.shape}, {shape.num_parameters() / 1e9:.2f}B parameters, {args.dtype} "
          f"({out.stat().st_size / 2**30:.2f} GiB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
