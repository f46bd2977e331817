"""The engine's command-line arguments, shared by `generate`, `bench` and `serve`, and the one way
each of them turns what it was given into the settings the engine is built from.

Precedence, key by key: a value given on the command line, then the --config file's
(config_file.py), then the default; LLM(config=...) resolves its keyword arguments the same way
(config_file.pick). The arguments a file can set therefore default to None here, and the
functions below resolve them.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from specserve.config import PATH_METHODS, SPEC_METHODS
from specserve.config_file import pick
from specserve.errors import InvalidParameterError
from specserve.hardware import QUANTIZATIONS

AUTO = "auto"  # num_speculative_tokens: the engine chooses k each step by its cost model, up to a cap
SPECULATIVE_METHODS = ("none", *SPEC_METHODS)
LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")
TREE_KEYS = ("num_draft_nodes", "draft_topk", "enable_suffix_decoding", "suffix_threshold")
SUFFIX_KEYS = ("suffix_tree_depth", "suffix_cache_tokens", "suffix_spec_factor", "suffix_min_token_prob")
TYPICAL_KEYS = ("acceptance_method", "posterior_threshold", "posterior_alpha")
# speculative_config keys every method takes that flags set (besides the method, model and k).
SHARED_FLAG_KEYS = (*TYPICAL_KEYS, "disable_by_batch_size")
SELF_SPEC_KEYS = ("skip_layers",)
LOOKAHEAD_KEYS = ("lookahead_window", "lookahead_ngram", "lookahead_candidates")
# Every method's own keys that a command-line flag sets (generate, serve and bench take them all).
FLAG_KEYS = (*LOOKUP_KEYS, *SUFFIX_KEYS, *TREE_KEYS, *SELF_SPEC_KEYS, *LOOKAHEAD_KEYS)
# The engine arguments a command may have, as LLM's keyword arguments.
ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_step_ms", "block_size", "num_kv_blocks",
               "enable_prefix_caching")
SERVE_MAX_NUM_SEQS = 16  # a server's default batch (LLM's own default is smaller: one user's prompts)


def methods_help() -> str:
    """'none, ngram, ..., draft_model:PATH, eagle:DIR, medusa:DIR': the methods bench and tune take."""
    return ", ".join(m if m not in PATH_METHODS else f"{m}:{'PATH' if m == 'draft_model' else 'DIR'}"
                     for m in SPECULATIVE_METHODS)


# ---- arguments -------------------------------------------------------------------------------

def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="JSON settings, as `specserve tune` writes them: model, speculative_config, max_num_seqs, "
                        "max_num_batched_tokens (every key optional); options given on the command line win over it")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model folder, .gguf file, or 'default' (embedded SmolLM2-135M-Instruct; the default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="torch path dtype; an explicit dtype asks for the torch path (float32: the exact reference)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="auto: a quantized GGUF runs on its own blocks with specserve's native kernels, anything else "
                        "on the torch path; int8 / int4 (or a block format by name): quantize weights at load "
                        "(Q8_0 / Q4_1); none: torch path")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--max-model-len", type=int, default=None, help="context tokens per request (default: min(model context, 4096))")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """generate's and serve's speculation: one method (bench sweeps several with --methods)."""
    p.add_argument("--speculative", choices=SPECULATIVE_METHODS, default=None, help="drafting method (default none)")
    p.add_argument("--draft-model", default=None,
                   help="draft model path for draft_model; the drafter folder for eagle3 (`train-draft` or a published "
                        "EAGLE-3 checkpoint), eagle and medusa; 'default': the drafter shipped for the embedded model")
    p.add_argument("--num-speculative-tokens", type=_speculative_tokens_arg, default=None,
                   help="tokens drafted per step (k), or 'auto' (the default): the engine chooses k each step, up to a cap")
    add_lookup_args(p)
    add_suffix_args(p)
    add_tree_args(p)
    add_self_spec_args(p)
    add_lookahead_args(p)
    p.add_argument("--acceptance-method", choices=["rejection_sampler", "typical_acceptance_sampler"], default=None,
                   help="typical_acceptance_sampler: Medusa's typical acceptance for sampled requests; LOSSY "
                        "(output no longer exactly the target's distribution; greedy unchanged). "
                        "Default: rejection_sampler, lossless")
    p.add_argument("--posterior-threshold", type=float, default=None, help="typical acceptance: probability bar (0.09)")
    p.add_argument("--posterior-alpha", type=float, default=None, help="typical acceptance: entropy-scaled bar (0.3)")
    p.add_argument("--speculative-disable-by-batch-size", dest="disable_by_batch_size", type=int, default=None,
                   metavar="N", help="no drafting while N or more requests run (vLLM's disable_by_batch_size; "
                                     "default: the engine's cost model alone decides)")


def add_lookup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lookup-max", type=int, default=None, help="ngram: longest n-gram looked up (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=None, help="ngram: shortest n-gram looked up (default 1)")


def add_suffix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--suffix-tree-depth", type=int, default=None,
                   help="suffix: longest suffix matched, and the depth of the suffix trees (default 16)")
    p.add_argument("--suffix-cache-tokens", type=int, default=None,
                   help="suffix: tokens of earlier outputs kept in the global tree, least recently used out "
                        "(default 16384; 0: per-request trees only)")
    p.add_argument("--suffix-spec-factor", type=float, default=None,
                   help="suffix: draft depth per token of the matched suffix (default 1.0)")
    p.add_argument("--suffix-min-token-prob", type=float, default=None,
                   help="suffix: smallest estimated probability of a drafted token (default 0.1)")


def add_self_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-layers", type=_skip_layers_arg, default=None, metavar="I,J,...",
                   help="self_spec: the target's decoder layers its draft skips, e.g. 3,5,7 (default: the model's "
                        "layer set from `specserve self-spec-search`, shipped for the embedded model)")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-draft-nodes", type=int, default=None,
                   help="eagle3, eagle, medusa: draft-tree nodes verified per step (the tree's depth is "
                        "--num-speculative-tokens); default: eagle3 and eagle 8, medusa the tree it was trained with")
    p.add_argument("--draft-topk", type=int, default=None,
                   help="eagle3, eagle: children per expanded node (default 2)")
    p.add_argument("--enable-suffix-decoding", action="store_true", default=None,
                   help="eagle3, eagle: suffix decoding beside the drafter (suffix's trees at their defaults): each "
                        "step a request takes the suffix draft or the drafter's, whichever has kept more lately")
    p.add_argument("--suffix-threshold", type=float, default=None,
                   help="eagle3, eagle with --enable-suffix-decoding: take the suffix draft whenever it expects to "
                        "keep this many tokens (default: chosen by what each source's drafts kept)")


def add_lookahead_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookahead-window", type=int, default=None, help="lookahead: Jacobi window columns W (default 1)")
    p.add_argument("--lookahead-ngram", type=int, default=None, help="lookahead: n-gram size N (default 3)")
    p.add_argument("--lookahead-candidates", type=int, default=None,
                   help="lookahead: n-grams verified per step G (default 2)")


def add_engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """The engine's sizes: every command has the token budget of a step; a server also sets its
    batch and KV pool (generate runs one request, bench sets its own)."""
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens computed per engine step (default 2048)")
    p.add_argument("--max-step-ms", type=float, default=None,
                   help="while a request decodes, prompt chunks are cut to keep a step's predicted time within "
                        "this many ms, so one long prompt does not stall the other streams (default 100; 0: off)")
    if not serving:
        return
    p.add_argument("--max-num-seqs", type=int, default=None, help=f"requests running together (default {SERVE_MAX_NUM_SEQS})")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default 16)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: sized from memory)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)


def speculative_tokens(text: str) -> int | str:
    """One value of --num-speculative-tokens: an integer, or 'auto'."""
    text = text.strip()
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise InvalidParameterError("num_speculative_tokens", text, "must be an integer (tokens drafted per step) or "
                                    "'auto' (the engine chooses k each step)") from None


def _speculative_tokens_arg(text: str) -> int | str:
    try:
        return speculative_tokens(text)
    except InvalidParameterError as e:  # argparse reports ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(e)) from None


def skip_layers(text: str) -> list[int]:
    """--skip-layers: a comma list of layer indices."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError("skip_layers", text, "must be a comma list of layer indices, e.g. 3,5,7") from None


def _skip_layers_arg(text: str) -> list[int]:
    try:
        return skip_layers(text)
    except InvalidParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---- parsed arguments -> what the engine is built from ------------------------------------------

def load_kwargs(args: argparse.Namespace, file: dict) -> dict:
    """load_model's keyword arguments."""
    return {"model": pick(args.model, file, "model", "default"), "dtype": args.dtype, "device": args.device,
            "quantization": args.quantization, "max_model_len": getattr(args, "max_model_len", None)}


def given(args: argparse.Namespace, keys: tuple[str, ...]) -> dict:
    """The arguments among `keys` given on the command line (they default to None)."""
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def speculative_config(args: argparse.Namespace, file: dict) -> dict | None:
    """generate's and serve's speculative_config (None: no speculation)."""
    flags = {"method": args.speculative, "model": args.draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    flags = {k: v for k, v in flags.items() if v is not None} | given(args, FLAG_KEYS + SHARED_FLAG_KEYS)
    return merge_speculative(flags, file.get("speculative_config"))


def merge_speculative(flags: dict, base: dict | None) -> dict | None:
    """The speculative_config keys given on the command line (`flags`) over a config file's
    (`base`), key by key while both name the same method; a different method replaces the
    file's whole config, whose other keys were chosen for its own method. Flags another method
    uses are left out (--draft-model with ngram)."""
    method = flags.get("method", (base or {}).get("method", "none"))
    if method == "none":
        return None
    cfg = dict(base) if base is not None and base.get("method") == method else {"method": method}
    keys = ("num_speculative_tokens", *SHARED_FLAG_KEYS, *method_keys(method))
    cfg.update({k: v for k, v in flags.items() if k in keys})
    cfg.setdefault("num_speculative_tokens", AUTO)
    return cfg


def method_keys(method: str) -> tuple[str, ...]:
    """The speculative_config keys of `method` that flags set (besides method,
    num_speculative_tokens and the acceptance keys, which every method takes): its options'
    fields (in its module), and "model" for a method that drafts from a file."""
    from specserve.spec.registry import method_names, method_spec
    if method not in method_names():
        return ()  # SpeculativeConfig.from_dict names the allowed methods
    spec = method_spec(method)
    return (*(("model",) if spec.needs_model else ()), *(f.name for f in fields(spec.options_cls)))


def engine_kwargs(args: argparse.Namespace, file: dict) -> dict:
    """LLM's keyword arguments for the engine: max_model_len, and each engine argument this
    command has, given on the command line, else the config file's, else the default (LLM's own
    where none is set here). The file's max_num_seqs counts only where the command has
    --max-num-seqs."""
    kwargs = {"max_model_len": args.max_model_len}
    defaults = {"max_num_seqs": SERVE_MAX_NUM_SEQS}
    for key in ENGINE_KEYS:
        if key in vars(args) and (value := pick(getattr(args, key), file, key, defaults.get(key))) is not None:
            kwargs[key] = value
    return kwargs
