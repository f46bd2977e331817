"""Architecture hyper-parameters of a Llama-family model, read from config.json or GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specserve.errors import ModelLoadError
from specserve.model.families import GEMMA, hf_family_fields
from specserve.model.limits import (HF_KEYS, ROPE_TYPES, FieldReader, check_rope_scaling, read_dimensions, read_flag,
                                    read_hf_full_rotary, read_hf_windows, read_rope_theta)

# Architectures whose weights map onto the project's Llama-family model, each difference a flag
# of ModelConfig: Qwen2's qkv bias (attention_bias), Qwen3's per-head q/k RMSNorm (qk_norm) and
# free head_dim, Phi-3's fused qkv and gate/up tensors (split at load, weights.split_fused),
# Gemma 2 and 3's sandwich norms, GeGLU, scaled embeddings, soft-capping and local/global layers.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA)
SUPPORTED_ROPE_TYPES = ROPE_TYPES


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # rope_scaling as in HF config.json: {"rope_type": "llama3", "factor": ..., ...}; None = plain RoPE.
    rope_scaling: dict | None = None
    attention_bias: bool = False  # q, k and v projections have biases
    o_bias: bool = False  # the o projection has a bias (Llama and Qwen3 with attention_bias)
    # RMSNorm over each head's head_dim slice of q and of k (weights q_norm, k_norm [head_dim],
    # eps rms_norm_eps), after the projections and before RoPE: Qwen3.
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # The layers `window_layers` (indices) attend through a sliding window: a token at position
    # p sees the keys at positions (p - sliding_window, p]; the others see the whole context.
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()
    # RoPE base of the windowed layers where it is their own (Gemma 3's rope_local_base_freq:
    # plain RoPE there; rope_scaling applies to the global layers only). None: rope_theta.
    local_rope_theta: float | None = None
    # Gemma 2/3: RMSNorm on the attention's and the MLP's outputs too, before their residual
    # adds (post_attention_layernorm, then pre_/post_feedforward_layernorm around the MLP).
    # Every norm weight is kept as the (1 + w) the model multiplies by, as GGUF files store it.
    sandwich_norms: bool = False
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model dtype first (Gemma)
    # Attention scores are q.k * query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Soft-capping (Gemma 2): scores -> cap * tanh(scores / cap) before the mask and softmax,
    # and the final logits likewise; None: none.
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model architecture {self.architecture!r}; "
                f"specserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if any(not 0 <= i < self.num_layers for i in self.window_layers) or (self.sliding_window is None) != (
                not self.window_layers):
            raise ModelLoadError(f"window_layers {list(self.window_layers)} must be layers of the model's "
                                 f"{self.num_layers}, given with a sliding_window ({self.sliding_window})")

    @property
    def attention_scale(self) -> float:
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    def windowed(self, layer: int) -> bool:
        return layer in self.window_layers

    def subset(self, keep: Sequence[int]) -> "ModelConfig":
        """The config of a model made of the layers `keep` (increasing indices) alone."""
        return replace(self, num_layers=len(keep), window_layers=tuple(j for j, i in enumerate(keep)
                                                                        if i in self.window_layers))

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + (4 if self.sandwich_norms else 2) * self.hidden_size
            + (self.q_size + 2 * self.kv_size if self.attention_bias else 0)
            + (self.hidden_size if self.o_bias else 0)
            + (2 * self.head_dim if self.qk_norm else 0)
        )
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + self.hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: object, where: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config.json (both the rope_theta/rope_scaling and the
        newer rope_parameters spellings), every field checked (limits.py) before use."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(f"{where} must hold one JSON object of the model's hyper-parameters, "
                                 f"not a {type(cfg).__name__}")
        r = FieldReader(where, cfg.get)
        model_type = cfg.get("model_type") or ""
        archs = cfg.get("architectures") or []
        if not isinstance(model_type, str):
            r.fail("model_type", model_type, f"must be a string, one of {', '.join(SUPPORTED_ARCHITECTURES)}")
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            r.fail("architectures", archs, 'must be a list of class names such as ["LlamaForCausalLM"]')
        if model_type == "gemma3":  # the multimodal config: its text model sits under text_config
            r.fail("model_type", model_type, "specserve loads Gemma 3's text model (Gemma3ForCausalLM, model_type "
                   "gemma3_text), not the multimodal Gemma3ForConditionalGeneration")
        # (transformers' Gemma 3 text model is "gemma3_text"; GGUF calls it "gemma3")
        arch = (model_type or (archs[0].lower().removesuffix("forcausallm") if archs else "")).removesuffix("_text")
        if arch not in SUPPORTED_ARCHITECTURES:  # (before the sizes: a gpt2 config names other keys)
            raise ModelLoadError(
                f"unsupported model architecture {arch!r}; specserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers' Qwen3 config gives head_dim 128 where config.json names none, Gemma's 256.
        dims = read_dimensions(r, HF_KEYS, context_default=2048, eps_default=1e-6,
                               head_dim_default={"qwen3": 128, "gemma2": 256, "gemma3": 256}.get(arch))
        family = hf_family_fields(r, arch, cfg.keys())
        rope_params = cfg.get("rope_parameters") or {}
        if arch == "gemma3" and "full_attention" in rope_params:  # per layer kind: the global layers'
            rope_params = rope_params["full_attention"] if isinstance(rope_params["full_attention"], dict) else {}
        if not isinstance(rope_params, dict):
            r.fail("rope_parameters", rope_params, "must be an object such as {\"rope_theta\": 10000.0}")
        rope_scaling = cfg.get("rope_scaling") or None
        key = "rope_scaling"
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
            key = "rope_parameters"
        theta_key, raw_theta = (("rope_theta", cfg["rope_theta"]) if "rope_theta" in cfg
                                else ("rope_parameters.rope_theta", rope_params.get("rope_theta")))
        theta = read_rope_theta(FieldReader(where, {theta_key: raw_theta}.get), theta_key,
                                1e6 if arch == "gemma3" else 10000.0)
        read_hf_full_rotary(r, rope_params)
        # Qwen2 always has a qkv bias and no config flag for it; Llama's and Qwen3's flag also
        # puts a bias on the o projection (transformers' modelling), Qwen2's and Mistral's not.
        attention_bias = read_flag(r, "attention_bias", arch == "qwen2")
        window, window_layers = read_hf_windows(r, arch, dims["num_layers"])
        return cls(
            architecture=arch,
            **dims,
            rope_theta=theta,
            rope_scaling=check_rope_scaling(r, key, rope_scaling, dims["max_position_embeddings"]),
            attention_bias=attention_bias,
            o_bias=attention_bias and arch in ("llama", "qwen3", *GEMMA),
            qk_norm=arch in ("qwen3", "gemma3"),
            tie_word_embeddings=read_flag(r, "tie_word_embeddings", arch in GEMMA),
            sliding_window=window,
            window_layers=window_layers,
            **family,
        )



def check_layer_subset(keep: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`keep` as a tuple of distinct increasing layer indices in [0, num_layers), at least one."""
    keep = tuple(keep)
    if (not keep or any(isinstance(i, bool) or not isinstance(i, int) for i in keep)
            or list(keep) != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= num_layers):
        raise ValueError(f"layers to keep {list(keep)} must be distinct increasing indices in [0, {num_layers})")
    return keep


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies of RoPE, [head_dim // 2] float32, with the config's scaling applied
    (`local`: the windowed layers' own, plain RoPE of base local_rope_theta).

    Computed in float32 the same way the reference implementation does, so that positions far
    into the context get bit-identical angles.
    """
    dim = cfg.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if local:
        return 1.0 / (cfg.local_rope_theta ** exponents)
    inv = 1.0 / (cfg.rope_theta ** exponents)
    if cfg.rope_scaling and "freq_factors" in cfg.rope_scaling:
        # GGUF files of Llama 3.1 carry the scaled frequencies as per-frequency divisors.
        return inv / torch.tensor(cfg.rope_scaling["freq_factors"], dtype=torch.float32)
    kind = cfg.rope_type
    if kind == "linear":
        return inv / float(cfg.rope_scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`, and
        # interpolate smoothly in between.
        s = cfg.rope_scaling
        factor = float(s["factor"])
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old_len = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv
