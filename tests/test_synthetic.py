"""Random-weight GGUFs of standard shapes (bench/synthetic.py) and llama-bench beside
bench.forward (bench/llama_bench.py): the shapes are the published ones, a small file of the same
layout loads and generates on both specserve paths, and llama-bench's JSON turns into ms per pass."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from specserve import LLM, SamplingParams
from specserve.bench.llama_bench import find_llama_bench, llama_bench_ms, weight_bytes
from specserve.bench.synthetic import SHAPES, Shape, llama3_rope_divisors, tensor_shapes, write_synthetic_gguf
from specserve.model.loader import load_model


@pytest.mark.parametrize("name,billions", [("smollm2-1.7b", 1.71), ("llama-3.2-1b", 1.24), ("llama-3.2-3b", 3.21),
                                           ("qwen2.5-7b", 7.62)])
def test_shapes_have_the_published_parameter_counts(name, billions):
    assert SHAPES[name].num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama3_divisors_follow_the_scaling_rule():
    d = llama3_rope_divisors(SHAPES["llama-3.2-1b"])
    assert d.shape == (32,) and d[0] == 1.0 and d[-1] == 32.0 and np.all(np.diff(d) >= 0)


@pytest.mark.parametrize("shape", [Shape("llama", 64, 2, 4, 2, 128, 400, True, 10000.0, llama3_rope=True),
                                   Shape("qwen2", 64, 2, 4, 2, 128, 400, False, 1e6, qkv_bias=True)],
                         ids=["llama3-tied", "qwen2-untied-bias"])
def test_a_small_file_of_the_layout_loads_and_generates(tmp_path, shape):
    path = write_synthetic_gguf(shape, tmp_path / "m.gguf")
    for quantization in ("none", "int8"):
        loaded = load_model(path, quantization=quantization)
        assert (loaded.config.num_layers, loaded.config.hidden_size, loaded.config.vocab_size) == (2, 64, 400)
        assert loaded.config.tie_word_embeddings == shape.tied
        out = LLM(loaded=loaded).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                          use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    assert weight_bytes(loaded.model) > 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # Q8_0 layers and a head
    assert list(tensor_shapes(shape))[:2] == ["token_embd.weight", "rope_freqs.weight" if shape.llama3_rope
                                               else "blk.0.attn_norm.weight"]


def test_llama_bench_json_becomes_ms_per_pass(tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *'-n 0'*) echo '[{\"avg_ts\": 500.0}]';; *) echo '[{\"avg_ts\": 100.0}]';; esac\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert find_llama_bench(str(fake)) == str(fake)
    assert llama_bench_ms(str(fake), tmp_path / "m.gguf", 100, 1, 2) == pytest.approx(10.0)  # 100 tok/s generation
    assert llama_bench_ms(str(fake), tmp_path / "m.gguf", 100, 5, 2) == pytest.approx(10.0)  # 5 tokens at 500 tok/s
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho oops >&2\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(RuntimeError, match="llama-bench failed \\(3\\): oops"):
        llama_bench_ms(str(broken), tmp_path / "m.gguf", 100, 1, 2)


def test_a_llama_bench_that_crashes_with_repacked_weights_is_measured_without_them(tmp_path, capsys):
    """This Xeon's llama.cpp build crashes (SIGSEGV) in its AMX repacked-weight path on any
    batch of more than one token: the measurement is taken again with --repack 0, said once."""
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in *'--repack 0'*) echo '[{\"avg_ts\": 250.0}]';; *) kill -SEGV $$;; esac\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert llama_bench_ms(str(fake), tmp_path / "m.gguf", 100, 1, 2) == pytest.approx(4.0)
    assert llama_bench_ms(str(fake), tmp_path / "m.gguf", 100, 5, 2) == pytest.approx(20.0)
    assert capsys.readouterr().err.count("measured with --repack 0") == 1


def test_forward_bench_takes_a_requantization_as_a_path(tmp_path):
    """bench.forward's paths: the native formats by name re-quantize an F16 file at load (what
    the 1.7B-shaped measurements use without llama.cpp's quantizer), dtypes stay torch's."""
    from specserve.bench.forward import _load

    path = write_synthetic_gguf(Shape("llama", 64, 2, 4, 2, 128, 400, True, 10000.0), tmp_path / "m.gguf")
    q4 = _load(str(path), "q4_0", "cpu", 64)
    assert q4.model.native and q4.model.quantization == "q4_0"
    assert weight_bytes(q4.model) < weight_bytes(_load(str(path), "q8_0", "cpu", 64).model)
    assert not getattr(_load(str(path), "float32", "cpu", 64).model, "native", False)


def test_forward_bench_times_trees_of_the_asked_size(tmp_path):
    """bench.forward --tree: T tokens as a root and T - 1 nodes, two children a node (the shape
    tree drafters verify), timed through the runner like chains."""
    from specserve.bench.forward import _load, binary_tree_mask, step_times
    from specserve.model.runner import ModelRunner

    assert binary_tree_mask(1) is None
    mask = binary_tree_mask(7)  # root, 2 children, 4 grandchildren
    assert mask.shape == (7, 7) and (mask.sum(-1) - 1).tolist() == [0, 1, 1, 2, 2, 2, 2]
    assert mask[3, 1] and not mask[3, 2] and mask[6, 2] and not mask[6, 1]
    path = write_synthetic_gguf(Shape("llama", 64, 2, 4, 2, 128, 400, True, 10000.0), tmp_path / "m.gguf")
    loaded = _load(str(path), "q8_0", "cpu", 64)
    runner = ModelRunner.dense(loaded.model, num_slots=1, max_len=48)
    times = step_times(runner, 40, [1, 7], rounds=2, vocab=400, tree=True)
    assert {t: len(v) for t, v in times.items()} == {1: 2, 7: 2} and min(min(v) for v in times.values()) > 0


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_1"])
def test_qgemm_bench_prints_one_row_per_copies_and_size(capsys, fmt):
    """bench.qgemm times the product alone, hot in cache (one copy) and streamed (several):
    one row per (copies, T), the first size's ratio 1, cycles per unit-row with --ghz."""
    from specserve.bench.qgemm import main

    main(["--format", fmt, "--rows", "64", "--cols", "128", "--sizes", "1", "3", "--copies", "1", "2",
          "--rounds", "2", "--threads", "1", "--ghz", "3.0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("#") and f"{fmt} [64 x 128]" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[2]) for r in rows] == [("1", "1"), ("1", "3"), ("2", "1"), ("2", "3")]
    assert rows[0][6] == "1.00" and rows[2][6] == "1.00"
    assert all(len(r) == 8 and float(r[3]) > 0 and float(r[7]) > 0 for r in rows)
    with pytest.raises(SystemExit):
        main(["--rows", "40"])


def test_qgemm_bench_takes_a_tensor_from_a_gguf(tmp_path, capsys):
    """bench.qgemm --gguf measures a file's own blocks (any type the kernels take); a tensor they
    do not take, or one the file lacks, is refused with its name."""
    import gguf
    from gguf.quants import quantize

    from specserve.bench.qgemm import main

    path = tmp_path / "w.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    x = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    w.add_tensor("blk.0.ffn_up.weight", quantize(x, gguf.GGMLQuantizationType.Q5_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q5_0)
    w.add_tensor("blk.0.ffn_down.weight", x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    main(["--gguf", str(path), "--tensor", "blk.0.ffn_up.weight", "--sizes", "1", "--copies", "1", "--rounds", "1"])
    out = capsys.readouterr().out.splitlines()
    assert "blk.0.ffn_up.weight Q5_0 [32 x 64]" in out[0] and len(out) == 3
    for tensor, says in (("blk.0.ffn_down.weight", "F16 [32 x 64]: not a format"), ("nope", "has no 2-D tensor 'nope'")):
        with pytest.raises(SystemExit):
            main(["--gguf", str(path), "--tensor", tensor])
        assert says in capsys.readouterr().err
