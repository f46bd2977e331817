"""What the Gemma family adds to the Llama-family config, read from config.json and from GGUF
metadata (limits.py's reader: each field checked, a bad one refused by name).

Gemma 2 and 3 differ from Llama in flags of ModelConfig: RMSNorm around both the attention and
the MLP (sandwich_norms) with (1 + w) weights, GeGLU, embeddings scaled by sqrt(hidden), the
attention scale query_pre_attn_scalar ** -0.5, soft-capping (Gemma 2), per-head q/k norms and
local layers with their own RoPE base (Gemma 3). Settings that change the model in ways
specserve does not compute (bidirectional attention, another activation) are refused by name.
"""

from __future__ import annotations

from collections.abc import Collection

from specserve.model.limits import MAX_LAYERS, FieldReader, read_flag, read_rope_theta

GEMMA = ("gemma2", "gemma3")
# transformers' names for the tanh approximation of GELU (the same function).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
# Gemma 2's defaults in transformers (and in llama.cpp where a GGUF omits the key).
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def _softcap(r: FieldReader, key: str, default: float | None) -> float | None:
    """A soft-capping value: None (the key null, or absent without a default) or a positive number."""
    if r.lookup(key) is None and default is None:
        return None
    return r.number(key, 0.0, default=default)


def _common(arch: str) -> dict:
    return dict(sandwich_norms=True, activation="gelu_tanh", embed_scale=True)


def hf_family_fields(r: FieldReader, arch: str, keys: Collection[str]) -> dict:
    """ModelConfig's family fields from a config.json whose keys are `keys` (none for the Llama
    family)."""
    if arch not in GEMMA:
        return {}
    if read_flag(r, "use_bidirectional_attention", False):
        r.fail("use_bidirectional_attention", True, "specserve computes causal attention only")
    act = r.lookup("hidden_activation") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        r.fail("hidden_activation", act, f"specserve computes the tanh approximation of GELU ({', '.join(_GELU_TANH)})")
    out = _common(arch) | dict(query_pre_attn_scalar=r.number("query_pre_attn_scalar", 0.0, default=256))
    if arch == "gemma2":
        # (config.json's null is transformers' "no cap", an absent key its default)
        for key, default in _GEMMA2_SOFTCAPS.items():
            out[key] = _softcap(r, key, default if key not in keys else None)
        return out
    if r.lookup("attn_logit_softcapping") is not None:
        r.fail("attn_logit_softcapping", r.lookup("attn_logit_softcapping"),
               "must be null: Gemma 3 has no attention soft-capping (transformers and llama.cpp apply none)")
    out["final_logit_softcapping"] = _softcap(r, "final_logit_softcapping", None)
    local = r.lookup("rope_local_base_freq")
    params = r.lookup("rope_parameters")
    if local is None and isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        sliding = params["sliding_attention"]
        if sliding.get("rope_type", "default") != "default":
            r.fail("rope_parameters.sliding_attention.rope_type", sliding.get("rope_type"),
                   "the local layers' RoPE must be plain (default)")
        local = sliding.get("rope_theta")
        out["local_rope_theta"] = read_rope_theta(FieldReader(r.where, {"rope_parameters.sliding_attention."
                                                                        "rope_theta": local}.get),
                                                  "rope_parameters.sliding_attention.rope_theta", 10000.0)
    else:
        out["local_rope_theta"] = read_rope_theta(r, "rope_local_base_freq", 10000.0)
    return out


def gguf_family_fields(r: FieldReader, arch: str, dims: dict) -> dict:
    """ModelConfig's family fields and windows from a GGUF's metadata, as llama.cpp reads them.
    GGUF has no key for query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B
    models (by their layer count: 46 for Gemma 2, 62 for Gemma 3) and head_dim for the others."""
    layers = dims["num_layers"]
    if arch not in GEMMA:
        window = r.lookup(f"{arch}.attention.sliding_window")
        # (llama.cpp, like transformers, gives the llama architecture full attention whatever the key says)
        if arch == "llama" or window is None:
            return {}
        return dict(sliding_window=r.integer(f"{arch}.attention.sliding_window", 1, 2**24),
                    window_layers=tuple(range(layers)))
    big = layers == (46 if arch == "gemma2" else 62)
    out = _common(arch) | dict(query_pre_attn_scalar=float(dims["hidden_size"] // dims["num_heads"] if big
                                                           else dims["head_dim"]))
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = r.lookup(pattern_key)
    if isinstance(pattern, list):  # one flag per layer (true: windowed)
        if len(pattern) != layers or any(not isinstance(p, bool) for p in pattern):
            r.fail(pattern_key, pattern, f"must be {layers} true/false flags or a period")
        windowed = tuple(i for i, p in enumerate(pattern) if p)
    else:
        period = r.integer(pattern_key, 1, MAX_LAYERS, default=2 if arch == "gemma2" else 6)
        windowed = tuple(i for i in range(layers) if (i + 1) % period)
    window_key = f"{arch}.attention.sliding_window"
    if windowed and (arch == "gemma2" or r.lookup(window_key) is not None):
        out |= dict(sliding_window=r.integer(window_key, 1, 2**24, default=4096), window_layers=windowed)
    if arch == "gemma2":
        for key, default in _GEMMA2_SOFTCAPS.items():
            out[key] = _softcap(r, f"{arch}.{key}", default)
    else:
        cap = r.lookup(f"{arch}.final_logit_softcapping")
        out["final_logit_softcapping"] = _softcap(r, f"{arch}.final_logit_softcapping", None) if cap else None
        out["local_rope_theta"] = read_rope_theta(r, f"{arch}.rope.freq_base_swa", 10000.0)
    return out
