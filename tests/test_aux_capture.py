"""Capturing the residual streams entering chosen layers (EAGLE-3's target states) inside the
target's own pass: the native capture against the torch path's (tolerance: the native path
quantizes activations to int8 before every product), the torch capture against the layers'
actual inputs (exact), hidden states unchanged by capturing (exact), bad layer lists refused."""

import pytest
import torch

from specserve import native
from specserve.errors import InvalidParameterError
from specserve.model.flat_batch import flat_batch
from specserve.model.loader import load_model
from tests.helpers import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")

LAYERS, BLOCK = 3, 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("aux") / "m", vocab_size=64, hidden=64, layers=LAYERS)
    return load_model(folder, dtype="float32").model, load_model(folder, quantization="int8").model


def _batch():
    """Two requests: 7 prompt tokens, and 3 tokens after 5 already cached (its first pass)."""
    return (flat_batch([[3, 9, 17, 4, 22, 8, 5], [40, 41, 2, 7, 11]], [[0, 1], [2, 3]], BLOCK, [0, 0]),
            flat_batch([[12, 13, 14]], [[2, 3]], BLOCK, [5]))


def _caches(model):
    cfg = model.config
    shape = (cfg.num_layers, 4 * BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=model.kv_dtype), torch.zeros(shape, dtype=model.kv_dtype)


def _run(model, aux_layers=None):
    """Both passes on one fresh cache -> [(hidden, aux or None)] per pass."""
    k, v = _caches(model)
    out = []
    for batch in _batch():
        if aux_layers is None:
            out.append((model.forward_flat(batch, k, v), None))
        else:
            out.append(model.forward_flat_aux(batch, k, v, aux_layers))
    return out


@pytest.mark.parametrize("aux_layers", [(0, 1, 2), (1,), (0, 2)])
def test_native_capture_matches_the_torch_paths(models, aux_layers):
    ref, nat = models
    hidden = ref.config.hidden_size
    for (_, a), (_, b) in zip(_run(ref, aux_layers), _run(nat, aux_layers)):
        assert a.shape == b.shape == (a.shape[0], len(aux_layers) * hidden)
        for j, layer in enumerate(aux_layers):
            x, y = a[:, j * hidden:(j + 1) * hidden], b[:, j * hidden:(j + 1) * hidden]
            if layer == 0:  # the float embeddings themselves on both paths
                assert torch.equal(x, y)
            else:  # the int8 bound of test_native_model's logits (measured here: 0.02-0.035)
                assert ((x - y).norm() / x.norm()).item() < 0.15, (layer, j)


def test_torch_capture_is_each_layers_input(models):
    ref, _ = models
    seen = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0].clone()))
             for i, layer in enumerate(ref.layers)]
    try:
        k, v = _caches(ref)
        _, aux = ref.forward_flat_aux(_batch()[0], k, v, (0, 2))
    finally:
        for h in hooks:
            h.remove()
    hidden = ref.config.hidden_size
    assert torch.equal(aux[:, :hidden], seen[0]) and torch.equal(aux[:, hidden:], seen[2])


@pytest.mark.parametrize("path", ["torch", "native"])
def test_capturing_leaves_the_hidden_states_bit_identical(models, path):
    model = models[path == "native"]
    for (plain, _), (captured, _) in zip(_run(model), _run(model, (0, 1, 2))):
        assert torch.equal(plain, captured)


@pytest.mark.parametrize("path", ["torch", "native"])
@pytest.mark.parametrize("bad", [(), (1, 0), (1, 1), (LAYERS,), (-1, 0), (0.5,), (True,)])
def test_bad_aux_layers_are_refused(models, path, bad):
    model = models[path == "native"]
    k, v = _caches(model)
    with pytest.raises(InvalidParameterError, match=r"aux_layers=.*strictly increasing layer indices in \[0, 3\)"):
        model.forward_flat_aux(_batch()[0], k, v, bad)


def test_the_kernel_checks_its_aux_arguments(models):
    _, nat = models
    batch = _batch()[0]
    x = nat.embed_tokens(batch.token_ids)
    k, v = _caches(nat)
    args = (nat.level, x, batch.positions, batch.slots, k, v, batch.block_size, batch.q_start, batch.block_table,
            batch.prefix_len, None, None, None, None)
    n, hidden = x.shape
    cases = [((torch.tensor([2, 1]), torch.empty(n, 2 * hidden)), "strictly increasing"),
             ((torch.tensor([0, 3]), torch.empty(n, 2 * hidden)), r"in \[0, 3\)"),
             ((torch.tensor([0, 1]), torch.empty(n, hidden)), "aux_out must be contiguous float32"),
             ((torch.tensor([0], dtype=torch.int32), torch.empty(n, hidden)), "aux_layers must be a contiguous int64"),
             ((torch.tensor([0]), None), "come together")]
    for extra, message in cases:
        with pytest.raises(RuntimeError, match=message):
            nat.core.forward(*args, *extra)
