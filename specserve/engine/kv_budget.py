"""How many KV blocks a pool gets: the rule the target engine and the draft model share."""

from __future__ import annotations

import os

import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidParameterError
from specserve.model.loader import LoadedModel
from specserve.model.paged_attention import PagedKVCache


def memory_budget(kv_cache_memory: int | float, device: torch.device) -> int:
    """Bytes for the KV pool: kv_cache_memory itself, or that fraction of the device's free
    memory (CUDA: what the driver reports free; CPU: the OS's available physical memory)."""
    if kv_cache_memory > 1:
        return int(kv_cache_memory)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * kv_cache_memory)


def num_kv_blocks(target: LoadedModel, config: EngineConfig) -> int:
    """The pool's size in blocks; it must hold at least one request at full context, so
    that any admitted request can always run (alone, after preempting the others)."""
    per_request = -(-config.max_model_len // config.block_size)
    if config.num_kv_blocks is not None:
        num, what = config.num_kv_blocks, ("num_kv_blocks", config.num_kv_blocks)
    elif config.kv_cache_memory is not None:
        cfg = target.config
        num = PagedKVCache.num_blocks_for_budget(memory_budget(config.kv_cache_memory, target.model.device),
                                                 cfg.num_layers, config.block_size,
                                                 cfg.num_kv_heads, cfg.head_dim, target.model.dtype)
        what = ("kv_cache_memory", config.kv_cache_memory)
    else:
        return per_request * config.max_num_seqs
    if num < per_request:
        raise InvalidParameterError(
            what[0], what[1], f"gives {num} KV blocks of {config.block_size} tokens, but one request at "
            f"max_model_len={config.max_model_len} needs {per_request}; raise it or lower max_model_len")
    return num
