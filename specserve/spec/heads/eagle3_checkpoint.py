"""EAGLE-3 drafter checkpoints: reading the published layouts into canonical tensors, and
writing specserve's own drafters in the layout other engines read.

Every layout holds the same trained parts (see eagle3_config.py for the canonical names and
shapes); they differ in the config.json that sizes them, the prefix of the decoder layer's
tensors, and where the three target layers `fc` fuses are named. None stores a fused q/k/v or
gate/up matrix: q/k/v take 2H columns in every layout, as the canonical tensors do.

Layouts (as their own code and published files name things):

  eagle        SafeAILab/EAGLE's EAGLE-3 (eagle/model/cnets.py `Model`; configs like
               eagle/traineagle3/config.json and yuhuili/EAGLE3-LLaMA3.1-Instruct-8B):
               config.json is a Llama config ("architectures": ["LlamaForCausalLM"],
               num_hidden_layers 1) plus "draft_vocab_size" and, where the drafter's width
               differs from the target's, "target_hidden_size". Tensors: fc.weight,
               midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
               midlayer.self_attn.{q,k,v,o}_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight,
               norm.weight, lm_head.weight, d2t [Vd] int64, t2d [V] bool; no embed_tokens.weight
               (the target's embedding is frozen and left out when saving). EAGLE ships
               pytorch_model.bin, a pickle: it is refused here and must be converted to
               model.safetensors with the same names. Aux layers are never named: the
               reference captures the residual streams entering (2, L // 2, L - 3).
  specforge    SGLang's SpecForge (specforge/modeling/draft/llama3_eagle.py
               `LlamaForCausalLMEagle3`; configs/*-eagle3.json): the same tensor names and config
               keys, "architectures": ["LlamaForCausalLMEagle3"], weights in model.safetensors
               (embed_tokens.weight dropped when saving). Aux layers, when named, are
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]} counted as the OUTPUT of
               layer i (SpecForge hooks the layer's output; SGLang captures i + 1), so the
               residual stream entering layer i + 1; absent, SpecForge's default (1, L//2 - 1, L - 4)
               is the same three streams as the reference's.
  speculators  vLLM's speculators (`Eagle3SpeculatorConfig`, speculators_model_type "eagle3",
               "architectures": ["Eagle3Speculator"]): the layer's sizes are under
               "transformer_layer_config" (a Llama config), and "draft_vocab_size",
               "target_hidden_size" (null: the drafter's width), "norm_before_residual" and
               "eagle_aux_hidden_state_layer_ids" at the top. vLLM indexes the latter as the layer
               whose ENTERING residual stream it captures (vllm/model_executor/models/llama.py
               appends hidden_states + residual before running layer i), our convention; absent,
               vLLM's default is (2, L // 2, L - 3). Tensors: the layer under layers.0.*
               (layers.0.self_attn.q_proj.weight, layers.0.mlp.gate_proj.weight, ...),
               fc.weight, norm.weight, lm_head.weight, d2t, t2d, and usually embed_tokens.weight,
               a copy of the target's embedding, read as `own_embedding`.
  specserve    What write_eagle3 writes: the specforge layout (names, d2t/t2d, config keys) so
               SGLang and vLLM load it, with the aux layers in both engines' conventions (top-level
               "eagle_aux_hidden_state_layer_ids" as entering streams for vLLM, "eagle_config" as
               layer outputs for SGLang), "norm_before_residual" for vLLM, and a "specserve"
               object: {"format": 1, "aux_layers": [...], "extra": {...}} (target identity,
               training record). Its aux_layers are authoritative; the other two must agree.

d2t [Vd] holds offsets: draft row r stands for target id r + d2t[r] (vLLM's
`draft_id_to_target_id`, EAGLE's `topk_index + d2t[topk_index]`); t2d [V] marks exactly those
target ids. Where draft_vocab_size equals the vocabulary, d2t may be absent (identity rows).

Variants whose extra tensors the drafter has no place for are refused by name: a Qwen3 decoder
layer (per-head q/k norms), more than one decoder layer, "norm_before_fc" (a norm over the three
fused states), "fc_norm"/"norm_output", attention or MLP biases, an activation other than SiLU.

A checkpoint is untrusted input. Every size in config.json is checked for its type and range
(model/limits.py), the drafter is checked against the target, and every tensor's name, shape and
dtype is checked from the safetensors headers before any tensor data is read; each refusal is one
ModelLoadError line naming the file and the field or tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specserve.errors import ModelLoadError
from specserve.model.config import SUPPORTED_ROPE_TYPES, ModelConfig
from specserve.model.hf_loader import read_json, safetensors_files
from specserve.model.limits import (HF_KEYS, MAX_HIDDEN, MAX_LAYERS, MAX_VOCAB, DimensionKeys, FieldReader,
                                    check_rope_scaling, read_dimensions, read_flag, read_rope_theta)
from specserve.model.weights import ignored_tensor
from specserve.spec.heads.eagle3_config import DRAFT_IDS, OWN_EMBEDDING, Eagle3Config, default_aux_layers

LAYOUTS = ("eagle", "specforge", "speculators", "specserve")
SPECSERVE_FORMAT = 1
FLOAT_DTYPES = ("F32", "F16", "BF16")
ID_DTYPES = ("I64", "I32")
MASK_DTYPES = ("BOOL", "U8")
# The drafter's layer, canonical name -> its name under the layer prefix in every layout.
_LAYER_NAMES = {
    "layer.input_layernorm.weight": "input_layernorm.weight",
    "layer.hidden_norm.weight": "hidden_norm.weight",
    "layer.q_proj.weight": "self_attn.q_proj.weight",
    "layer.k_proj.weight": "self_attn.k_proj.weight",
    "layer.v_proj.weight": "self_attn.v_proj.weight",
    "layer.o_proj.weight": "self_attn.o_proj.weight",
    "layer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "layer.gate_proj.weight": "mlp.gate_proj.weight",
    "layer.up_proj.weight": "mlp.up_proj.weight",
    "layer.down_proj.weight": "mlp.down_proj.weight",
}
_LAYER_PREFIX = {"eagle": "midlayer.", "specforge": "midlayer.", "specserve": "midlayer.", "speculators": "layers.0."}
_D2T, _T2D = "d2t", "t2d"
# Set true, these add tensors (or change the layer) beyond what Eagle3Head holds.
_UNSUPPORTED_FLAGS = {"fc_norm": "a norm on fc's output", "norm_output": "a norm on the layer's output",
                      "norm_before_fc": "a norm over the three fused target states",
                      "attention_bias": "biases on q/k/v/o", "mlp_bias": "biases on the MLP"}
_LAYER_FLAGS = ("attention_bias", "mlp_bias")  # under speculators' transformer_layer_config; the rest top-level


@dataclass(frozen=True)
class Eagle3Checkpoint:
    config: Eagle3Config
    tensors: dict[str, torch.Tensor]  # canonical names: float32; draft_ids [Vd] int64
    own_embedding: torch.Tensor | None  # [V, H] float32, where the checkpoint carries one
    layout: str  # one of LAYOUTS
    extra: dict  # the "specserve" object's "extra" (target identity, training record); {} elsewhere


def checkpoint_names(layout: str) -> dict[str, str]:
    """A layout's tensor names -> canonical names ("d2t" and "t2d" keep theirs: they become draft_ids)."""
    prefix = _LAYER_PREFIX[layout]
    names = {prefix + ours: canonical for canonical, ours in _LAYER_NAMES.items()}
    names |= {n: n for n in ("fc.weight", "norm.weight", "lm_head.weight", _D2T, _T2D, OWN_EMBEDDING)}
    return names


def detect_layout(doc: dict, where: str) -> str:
    """Which layout a config.json document is, from its own markers."""
    archs = doc.get("architectures")
    archs = archs if isinstance(archs, list) else []
    if "specserve" in doc:
        return "specserve"
    if "speculators_model_type" in doc:
        if doc["speculators_model_type"] != "eagle3":
            FieldReader(where, doc.get).fail("speculators_model_type", doc["speculators_model_type"],
                                             "only 'eagle3' is an EAGLE-3 drafter")
        return "speculators"
    if "LlamaForCausalLMEagle3" in archs:
        return "specforge"
    if "draft_vocab_size" in doc and "LlamaForCausalLM" in archs:
        return "eagle"
    raise ModelLoadError(f"{where} is not an EAGLE-3 drafter's config: expected \"architectures\": "
                         f"[\"LlamaForCausalLMEagle3\"] (SpecForge), \"LlamaForCausalLM\" with a draft_vocab_size "
                         f"(EAGLE), or \"speculators_model_type\": \"eagle3\" (speculators); got architectures="
                         f"{repr(archs)[:120]}")


def read_eagle3(folder: str | Path, target: ModelConfig) -> Eagle3Checkpoint:
    """A drafter folder (config.json + model.safetensors, or shards with an index) checked
    against `target` and mapped to canonical tensors."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; an EAGLE-3 drafter folder needs one")
    doc = read_json(path)
    if not isinstance(doc, dict):
        raise ModelLoadError(f"{path} must hold a JSON object (an EAGLE-3 drafter's config), not {type(doc).__name__}")
    layout = detect_layout(doc, str(path))
    config, extra = _read_config(doc, layout, str(path), target)
    config.check_target(target, str(path))
    found = _check_headers(folder, layout, config)
    draft_ids = _draft_ids(found, config)
    tensors = {name: _load(found[name]).float() for name in config.tensor_shapes() if name != DRAFT_IDS}
    tensors[DRAFT_IDS] = draft_ids
    own = _load(found[OWN_EMBEDDING]).float() if OWN_EMBEDDING in found else None
    return Eagle3Checkpoint(config=config, tensors=tensors, own_embedding=own, layout=layout, extra=extra)


def write_eagle3(folder: str | Path, config: Eagle3Config, tensors: dict[str, torch.Tensor], extra: dict,
                 dtype: torch.dtype = torch.float32) -> None:
    """specserve's drafter files: model.safetensors (`dtype`, SpecForge names, d2t/t2d) and a
    config.json SGLang and vLLM read, with the "specserve" object. `tensors` holds every
    canonical tensor, embed_tokens.weight [V, H] optionally; `extra` must be JSON-serialisable."""
    want = config.tensor_shapes() | {OWN_EMBEDDING: (config.vocab_size, config.hidden_size)}
    missing = sorted(set(config.tensor_shapes()) - set(tensors))
    unknown = sorted(set(tensors) - set(want))
    if missing or unknown:
        raise ValueError(f"write_eagle3: tensors missing {missing}, unknown {unknown}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != want[name]:
            raise ValueError(f"write_eagle3: {name} has shape {tuple(tensor.shape)}, the config needs {want[name]}")
    draft_ids = tensors[DRAFT_IDS].to(torch.int64).cpu()
    outside = (draft_ids < 0).any() or (draft_ids >= config.vocab_size).any()
    if outside or draft_ids.unique().numel() != draft_ids.numel():
        raise ValueError("write_eagle3: draft_ids must be distinct target ids in [0, vocab_size)")
    names = {canonical: ours for ours, canonical in checkpoint_names("specserve").items()}
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"write_eagle3: dtype {dtype} is not float32, bfloat16 or float16")
    out = {names[n]: t.detach().to("cpu", dtype).contiguous() for n, t in tensors.items() if n != DRAFT_IDS}
    out[_D2T] = draft_ids - torch.arange(config.draft_vocab_size)
    out[_T2D] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    doc = _specforge_config(config, str(dtype).removeprefix("torch.")) | {"specserve": {"format": SPECSERVE_FORMAT, "aux_layers": list(config.aux_layers),
                                                      "extra": extra}}
    text = json.dumps(doc, indent=2)  # before any file is written: unserialisable extra leaves nothing behind
    folder = Path(folder)
    # Readers take an index's shards over model.safetensors: stale ones would shadow these weights.
    stale = sorted(p.name for p in folder.glob("*.safetensors*") if p.name != "model.safetensors")
    if stale:
        raise ValueError(f"write_eagle3: {folder} already holds other weight files {stale}; write to an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(text + "\n", encoding="utf-8")


def _specforge_config(cfg: Eagle3Config, dtype: str) -> dict:
    """SpecForge's config keys (what SGLang's LlamaForCausalLMEagle3 and vLLM's
    Eagle3LlamaForCausalLM read), aux layers in each engine's convention."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": dtype,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers],
                         "use_aux_hidden_state": True},
    }


def _read_config(doc: dict, layout: str, where: str, target: ModelConfig) -> tuple[Eagle3Config, dict]:
    """Eagle3Config from a config.json document, every field checked before anything is sized by it."""
    if layout == "speculators":
        tl = doc.get("transformer_layer_config")
        if not isinstance(tl, dict):
            raise ModelLoadError(f"{where}: transformer_layer_config must be an object (the drafter layer's "
                                 f"Llama config), not {type(tl).__name__}")
        prefix = "transformer_layer_config."
        if tl.get("model_type", "llama") != "llama":
            FieldReader(where, doc.get).fail(prefix + "model_type", tl["model_type"], "only a 'llama' decoder layer "
                                             "is supported (a Qwen3 layer adds per-head q/k norms)")
        keys = DimensionKeys(*(prefix + k for k in (HF_KEYS.vocab_size, HF_KEYS.hidden_size,
                                                    HF_KEYS.intermediate_size, HF_KEYS.num_layers, HF_KEYS.num_heads,
                                                    HF_KEYS.num_kv_heads, HF_KEYS.head_dim, HF_KEYS.context,
                                                    HF_KEYS.rms_norm_eps)))
        r = FieldReader(where, lambda k: tl.get(k.removeprefix(prefix)) if k.startswith(prefix) else doc.get(k))
    else:
        prefix, keys = "", HF_KEYS
        r = FieldReader(where, doc.get)
    for key, what in _UNSUPPORTED_FLAGS.items():
        full = prefix + key if key in _LAYER_FLAGS else key
        if read_flag(r, full, False):
            r.fail(full, True, f"must be false: the drafter has no place for {what}")
    act = r.lookup(prefix + "hidden_act")
    if act not in (None, "silu"):
        r.fail(prefix + "hidden_act", act, "must be \"silu\" (the drafter's MLP is SwiGLU)")
    # LlamaConfig's defaults where a key is left out: 2048 positions, eps 1e-6, theta 10000.
    dims = read_dimensions(r, keys, context_default=2048, eps_default=1e-6)
    if dims["num_layers"] != 1:
        r.fail(keys.num_layers, dims["num_layers"], "must be 1: an EAGLE-3 drafter has one decoder layer")
    theta = read_rope_theta(r, prefix + "rope_theta", 10000.0)
    scaling = check_rope_scaling(r, prefix + "rope_scaling", r.lookup(prefix + "rope_scaling"),
                                 dims["max_position_embeddings"])
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            r.fail(prefix + "rope_scaling", scaling, f"rope_type must be one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    vocab = dims["vocab_size"]
    aux, extra = _aux_layers(r, doc, layout, target)
    try:
        cfg = Eagle3Config(
            hidden_size=dims["hidden_size"],
            target_hidden_size=r.integer("target_hidden_size", 1, MAX_HIDDEN, default=dims["hidden_size"]),
            num_heads=dims["num_heads"], num_kv_heads=dims["num_kv_heads"], head_dim=dims["head_dim"],
            intermediate_size=dims["intermediate_size"], rms_norm_eps=dims["rms_norm_eps"], rope_theta=theta,
            rope_scaling=scaling, max_position_embeddings=dims["max_position_embeddings"], vocab_size=vocab,
            # Absent, the head covers the whole vocabulary (vLLM's reading).
            draft_vocab_size=r.integer("draft_vocab_size", 1, MAX_VOCAB, default=vocab),
            aux_layers=aux, norm_before_residual=read_flag(r, "norm_before_residual", False))
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    return cfg, extra


def _aux_layers(r: FieldReader, doc: dict, layout: str, target: ModelConfig) -> tuple[tuple[int, ...], dict]:
    """The target layers whose entering residual streams fc fuses, wherever the layout names
    them, and the "specserve" object's extra."""
    entering = _layer_ids(r, "eagle_aux_hidden_state_layer_ids", 0)
    outputs = None
    if layout != "speculators":
        nested = doc.get("eagle_config")
        if nested is not None and not isinstance(nested, dict):
            r.fail("eagle_config", nested,
                   "must be an object such as {\"eagle_aux_hidden_state_layer_ids\": [1, 15, 28]}")
        if nested:
            sub = FieldReader(r.where, lambda k: nested.get(k.removeprefix("eagle_config.")))
            # SGLang's convention: layer i's output, the stream entering layer i + 1 (-1: the embeddings).
            ids = _layer_ids(sub, "eagle_config.eagle_aux_hidden_state_layer_ids", -1)
            outputs = None if ids is None else tuple(i + 1 for i in ids)
    if entering is not None and outputs is not None and entering != outputs:
        r.fail("eagle_config.eagle_aux_hidden_state_layer_ids", [i - 1 for i in outputs],
               f"counts layer outputs (SGLang), so it reads the streams entering layers {list(outputs)}, but "
               f"eagle_aux_hidden_state_layer_ids (vLLM, entering streams) names {list(entering)}; they must agree")
    named = entering if entering is not None else outputs
    if layout != "specserve":
        if named is not None:
            return named, {}
        default = default_aux_layers(target.num_layers)
        if list(default) != sorted(set(default)) or default[0] < 0:
            raise ModelLoadError(f"{r.where}: names no aux layers, and the default for a target of {target.num_layers} "
                                 f"layers, {list(default)}, is not three increasing layers; name them in "
                                 f"eagle_aux_hidden_state_layer_ids")
        return default, {}
    section = doc["specserve"]
    if not isinstance(section, dict):
        r.fail("specserve", section, "must be an object {\"format\": 1, \"aux_layers\": [...], \"extra\": {...}}")
    own = FieldReader(r.where, lambda k: section.get(k.removeprefix("specserve.")))
    own.integer("specserve.format", SPECSERVE_FORMAT, SPECSERVE_FORMAT)
    aux = _layer_ids(own, "specserve.aux_layers", 0)
    if aux is None:
        own.fail("specserve.aux_layers", None, "is required: the three target layers the drafter reads")
    if named is not None and named != aux:
        r.fail("eagle_aux_hidden_state_layer_ids", list(named),
               f"must name the layers of specserve.aux_layers={list(aux)} (other engines read it)")
    extra = section.get("extra", {})
    if not isinstance(extra, dict):
        own.fail("specserve.extra", extra, "must be an object")
    return aux, extra


def _layer_ids(r: FieldReader, key: str, lo: int) -> tuple[int, ...] | None:
    value = r.lookup(key)
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 3
            or any(isinstance(i, bool) or not isinstance(i, int) or not lo <= i <= MAX_LAYERS for i in value)):
        r.fail(key, value, f"must be a list of three layer indices in [{lo}, {MAX_LAYERS}]")
    return tuple(value)



@dataclass(frozen=True)
class _Found:
    """Where one tensor lies: its file, the open handle, its name there."""

    file: Path
    handle: object
    name: str


def _check_headers(folder: Path, layout: str, cfg: Eagle3Config) -> dict[str, _Found]:
    """Every tensor's name, shape and dtype from the safetensors headers, against `cfg`: canonical
    name (or "d2t"/"t2d"/embed_tokens.weight) -> where it lies. No tensor data is read."""
    names = checkpoint_names(layout)
    shapes = {n: s for n, s in cfg.tensor_shapes().items() if n != DRAFT_IDS}
    shapes |= {_D2T: (cfg.draft_vocab_size,), _T2D: (cfg.vocab_size,), OWN_EMBEDDING: (cfg.vocab_size, cfg.hidden_size)}
    dtypes = {_D2T: ID_DTYPES, _T2D: MASK_DTYPES}
    found: dict[str, _Found] = {}
    for f in _weight_files(folder):
        try:
            handle = safe_open(str(f), framework="pt")
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read safetensors file {f}: {e}") from None
        for name in handle.keys():
            if ignored_tensor(name):
                continue
            canonical = names.get(name)
            if canonical is None:
                raise ModelLoadError(f"{f}: unexpected tensor {name!r} for an EAGLE-3 drafter in the {layout} layout "
                                     f"(its layer's tensors are {_LAYER_PREFIX[layout]}*)")
            if canonical in found:
                raise ModelLoadError(f"{f}: tensor {name} is also in {found[canonical].file}")
            part = handle.get_slice(name)
            shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if shape != shapes[canonical]:
                raise ModelLoadError(f"{f}: tensor {name} has shape {shape}, expected {shapes[canonical]} "
                                     f"from config.json")
            allowed = dtypes.get(canonical, FLOAT_DTYPES)
            if dtype not in allowed:
                raise ModelLoadError(f"{f}: tensor {name} has dtype {dtype}; allowed: {', '.join(allowed)}")
            found[canonical] = _Found(f, handle, name)
    required = set(shapes) - {_D2T, _T2D, OWN_EMBEDDING}
    if cfg.draft_vocab_size < cfg.vocab_size:  # a reduced head cannot do without its row -> token map
        required.add(_D2T)
    ours = {canonical: name for name, canonical in names.items()}
    missing = sorted(ours[n] for n in required - set(found))
    if missing:
        raise ModelLoadError(f"{folder}: tensors missing for this EAGLE-3 drafter ({layout} layout): "
                             f"{', '.join(missing)}")
    return found


def _weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (an index's shards, or every *.safetensors); a pickle
    checkpoint alone is refused, never opened."""
    if (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors")):
        return safetensors_files(folder)
    pickles = sorted(p.name for ext in ("bin", "pt", "pth", "pkl", "ckpt") for p in folder.glob(f"*.{ext}"))
    hint = (f" (found {pickles}: pickle checkpoints are never loaded; convert them to model.safetensors keeping "
            f"the tensor names)") if pickles else ""
    raise ModelLoadError(f"{folder} has no *.safetensors weight files{hint}")


def _load(found: _Found) -> torch.Tensor:
    try:
        return found.handle.get_tensor(found.name)
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"corrupt tensor {found.name} in {found.file}: {e}") from None


def _draft_ids(found: dict[str, _Found], cfg: Eagle3Config) -> torch.Tensor:
    """[Vd] int64 target id of each draft row, from d2t's offsets, checked to be distinct ids
    of the vocabulary and, where t2d is present, exactly the ids t2d marks."""
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    rows = torch.arange(vd)
    if _D2T not in found:  # the full vocabulary, row r is token r
        return rows
    where = found[_D2T].file
    d2t = _load(found[_D2T]).to(torch.int64)
    # Compared against bounds shifted by the row, so a crafted offset near 2**63 cannot wrap.
    outside = ((d2t < -rows) | (d2t >= v - rows)).nonzero()
    if len(outside):
        r = int(outside[0])
        raise ModelLoadError(f"{where}: d2t[{r}]={int(d2t[r])} maps draft row {r} to target id {r + int(d2t[r])}, "
                             f"outside the vocabulary [0, {v})")
    draft_ids = rows + d2t
    ordered = draft_ids.sort().values
    twice = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(twice):
        raise ModelLoadError(f"{where}: d2t maps two draft rows to target id {int(twice[0])}; each row must be a "
                             f"distinct token")
    if _T2D in found:
        marked = _load(found[_T2D]).to(torch.bool)
        named = torch.zeros(v, dtype=torch.bool).index_fill_(0, draft_ids, True)
        differ = (marked != named).nonzero()
        if len(differ):
            t = int(differ[0])
            state = "marks" if bool(marked[t]) else "leaves out"
            raise ModelLoadError(f"{found[_T2D].file}: t2d {state} target id {t}, but d2t "
                                 f"{'maps no draft row to it' if bool(marked[t]) else 'maps a draft row to it'}; "
                                 f"t2d must mark exactly the {vd} draft ids")
    return draft_ids
