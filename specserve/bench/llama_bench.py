"""llama.cpp's own `llama-bench` beside `specserve.bench.forward`, and the machine's read bandwidth.

A pass of T tokens after `context` cached ones is what llama-bench measures as prompt processing
`-p T -d context` (one batch of T) for T > 1, and as token generation `-n N -d context` for T = 1
(N one-token passes). It runs as a subprocess on the same file with the same thread count; the
two are measured in alternated pairs (specserve, llama.cpp, specserve, ...), because one run on a
shared machine can be off by 30% either way, and the median of each side is reported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from specserve.model.hugepages import HugeArena

# Token-generation passes llama-bench times per repetition at T = 1.
TG_TOKENS = 32

_NO_REPACK: set[str] = set()  # executables that crashed with their repacked weights


def find_llama_bench(explicit: str | None = None) -> str | None:
    """The llama-bench executable: `explicit`, else the one on the PATH, else None."""
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    return shutil.which("llama-bench")


def llama_bench_ms(exe: str, model: Path, context: int, tokens: int, threads: int, reps: int = 3) -> float:
    """ms per pass of `tokens` tokens after `context` ones, as llama-bench measures it (its mean)."""
    if tokens == 1:
        shape = ["-p", "0", "-n", str(TG_TOKENS)]
    else:
        shape = ["-p", str(tokens), "-n", "0", "-ub", str(max(tokens, 1)), "-b", str(max(tokens, 1))]
    cmd = [exe, "-m", str(model), "-t", str(threads), "-d", str(context), "-r", str(reps), "-o", "json", *shape]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if _killed(out.returncode):
        # llama.cpp's repacked weights (its AMX path on Xeons that have AMX) crash on any batch of
        # more than one token (SIGSEGV, or SIGILL for longer batches), the context's prefill
        # included: measure it on its plain kernels, and say so once.
        if exe not in _NO_REPACK:
            _NO_REPACK.add(exe)
            print(f"# llama-bench was killed by a signal ({out.returncode}) in its repacked-weight path; "
                  "measured with --repack 0", file=sys.stderr, flush=True)
        out = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {out.stderr.strip()[-400:]}")
    rows = json.loads(out.stdout)
    tps = float(rows[0]["avg_ts"])  # tokens per second over the measured repetitions
    return 1000.0 / tps if tokens == 1 else 1000.0 * tokens / tps


def _killed(returncode: int) -> bool:
    """Whether a process died of a signal: subprocess's -N, or a shell's 128 + N."""
    return returncode < 0 or 128 < returncode < 160


def read_bandwidth_gbs(size_mib: int = 1024, rounds: int = 5) -> float:
    """Streaming read bandwidth with torch's threads (GB/s, the best of `rounds`): a sum over a
    buffer far larger than any cache, which reads every byte once per round."""
    # The pages the weights live in (model/hugepages.py), so that a pass's fraction of this
    # compares like with like; zeros writes every page before the timing.
    buf = HugeArena().zeros((size_mib * 2**20 // 4,), torch.float32)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one pass reads: a native model's packed units (layers and head), or a
    torch model's parameters (the embedding table excluded: a pass reads only its rows)."""
    parts = getattr(model, "parts", None)
    if parts is not None:
        return int(sum(parts.layer_bytes) + parts.lm_head.units.numel())
    return int(sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n))
