"""How many KV blocks a pool gets: the rule the target engine and the draft model share.

The pool is allocated whole when the engine starts, so its size is checked against the memory
actually available then: an explicit size that does not fit is refused with the figures, and
the default (max_num_seqs requests at full context) is cut to a share of what is available, so
that a large --max-num-seqs never asks the machine for more than it has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidParameterError
from specserve.model.loader import LoadedModel
from specserve.model.paged_kv import PagedKVCache

# The default pool takes at most this share of the available memory: activations, the
# proposer's own pool and the rest of the process need the remainder.
DEFAULT_MEMORY_FRACTION = 0.5
_GIB = 1 << 30


def available_memory(device: torch.device) -> int:
    """Bytes a new allocation can take now: what the CUDA driver reports free, or the OS's
    estimate of available physical memory (MemAvailable: free pages plus reclaimable caches)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(kv_cache_memory: int | float, device: torch.device) -> int:
    """Bytes for the KV pool: kv_cache_memory itself, or that fraction of the available memory."""
    if kv_cache_memory > 1:
        return int(kv_cache_memory)
    return int(available_memory(device) * kv_cache_memory)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """A pool's size and where it came from (servers say both when they start)."""

    num_blocks: int
    block_size: int  # tokens per block
    block_bytes: int  # K and V of one block across all layers
    source: str  # why this size, in words
    dtype: torch.dtype  # what the pool stores (the model's kv_dtype): float16 halves block_bytes

    @property
    def num_bytes(self) -> int:
        return (self.num_blocks + 1) * self.block_bytes  # the pool keeps one trash block

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"KV pool of {self.num_blocks} blocks ({self.num_blocks * self.block_size} tokens, {dtype}, "
                f"{self.num_bytes / _GIB:.2f} GiB): {self.source}")


def plan_kv_pool(target: LoadedModel, config: EngineConfig) -> KVBudget:
    """The pool's size: `num_kv_blocks`, or what `kv_cache_memory` holds, or by default
    max_num_seqs requests at full context within DEFAULT_MEMORY_FRACTION of the available
    memory. It must hold at least one request at full context, so that any admitted request
    can always run (alone, after preempting the others)."""
    cfg = target.config
    device = target.model.device
    kv_dtype = target.model.kv_dtype
    block_bytes = PagedKVCache.bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim,
                                               kv_dtype)
    per_request = -(-config.max_model_len // config.block_size)
    available = available_memory(device)

    def fits(what: str, value: object, num_bytes: int) -> None:
        if num_bytes > available:
            raise InvalidParameterError(what, value, f"needs {num_bytes} bytes ({num_bytes / _GIB:.2f} GiB) of KV "
                                                     f"cache, but only {available} bytes ({available / _GIB:.2f} GiB)"
                                                     f" of {device.type} memory are available; lower it")

    if config.num_kv_blocks is not None:
        what, value = "num_kv_blocks", config.num_kv_blocks
        fits(what, value, (value + 1) * block_bytes)
        num, source = value, f"num_kv_blocks={value} as given"
    elif config.kv_cache_memory is not None:
        what, value = "kv_cache_memory", config.kv_cache_memory
        budget = memory_budget(value, device)
        if value > 1:
            fits(what, value, budget)
            source = f"kv_cache_memory={budget} bytes as given"
        else:
            source = f"kv_cache_memory={value} of the {available / _GIB:.2f} GiB available"
        num = PagedKVCache.num_blocks_for_budget(budget, cfg.num_layers, config.block_size, cfg.num_kv_heads,
                                                 cfg.head_dim, kv_dtype)
    else:
        wanted = per_request * config.max_num_seqs
        cap = int(available * DEFAULT_MEMORY_FRACTION) // block_bytes - 1
        full = f"max_num_seqs={config.max_num_seqs} requests at max_model_len={config.max_model_len}"
        if wanted <= cap:
            return KVBudget(wanted, config.block_size, block_bytes, full, kv_dtype)
        what, value = "max_model_len", config.max_model_len
        fits(what, value, (per_request + 1) * block_bytes)
        num = max(per_request, cap)
        source = (f"{DEFAULT_MEMORY_FRACTION:g} of the {available / _GIB:.2f} GiB available "
                  f"({full} would need {(wanted + 1) * block_bytes / _GIB:.2f} GiB)")
    _check_holds_one_request(num, config, what, value)
    return KVBudget(num, config.block_size, block_bytes, source, kv_dtype)


def num_kv_blocks(target: LoadedModel, config: EngineConfig) -> int:
    """The pool's size in blocks. The offline API plans it once (plan_kv_pool) and passes it
    on as num_kv_blocks, so that the draft model's pool and the target's get the same count,
    checked against memory before either was allocated."""
    if config.num_kv_blocks is None:
        return plan_kv_pool(target, config).num_blocks
    _check_holds_one_request(config.num_kv_blocks, config, "num_kv_blocks", config.num_kv_blocks)
    return config.num_kv_blocks


def _check_holds_one_request(num: int, config: EngineConfig, what: str, value: object) -> None:
    per_request = -(-config.max_model_len // config.block_size)
    if num < per_request:
        raise InvalidParameterError(
            what, value, f"gives {num} KV blocks of {config.block_size} tokens, but one request at "
            f"max_model_len={config.max_model_len} needs {per_request}; raise it or lower max_model_len")
