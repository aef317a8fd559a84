"""A Llama decoder (RMSNorm, RoPE, GQA, SwiGLU) over a paged KV cache, with prefill and batched decode.

``LlamaModel.forward(tokens, kv, ctx)`` runs one forward described by a ``StepContext`` (context.py:
``StepContext.for_prefill`` / ``for_decode``). ``load_model`` builds a model by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from faultlab.engine.choices import check_choice
from faultlab.engine.context import StepContext
from faultlab.engine.kvcache import BACKENDS, PagedKVCache
from faultlab.engine.shapes import ModelConfig
from faultlab.engine.weights import Int4Weight, Linear, ModelWeights, concat_rows


@lru_cache(maxsize=8)
def load_model(name: str, weight_dtype: str, backend: str, device: str, seed: int = 0):
    """(LlamaModel, tokenizer or None), cached per process: weights never change during a run."""
    from .config import get_preset

    if name == "smollm2":
        from .gguf_loader import load_smollm2

        config, weights, tokenizer = load_smollm2(weight_dtype=weight_dtype, device=device)
    else:
        from .weights import random_weights

        config, tokenizer = get_preset(name), None
        weights = random_weights(config, seed=seed, weight_dtype=weight_dtype, device=device)
    return LlamaModel(config, weights, backend=backend), tokenizer


@dataclass(frozen=True, eq=False)
class _Layer:
    """A block's weights as the forward uses them: q/k/v and gate/up fused along the rows."""

    attn_norm: torch.Tensor  # float32 [hidden]
    wqkv: Linear  # [q_dim + 2 * kv_dim, hidden]
    wo: Linear  # [hidden, q_dim]
    ffn_norm: torch.Tensor  # float32 [hidden]
    w_gate_up: Linear  # [2 * ffn, hidden]
    w_down: Linear  # [hidden, ffn]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] normalised in float32, scaled by weight [H], back in x's dtype."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


def rope_table(config: ModelConfig, device) -> torch.Tensor:
    """complex64 [max_context, head_dim // 2]: e^(i * pos * theta^(-2j / head_dim))."""
    d = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    angles = torch.arange(config.max_context, dtype=torch.float64, device=device)[:, None] * inv_freq
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) of x [T, H, D] by rot [T, D/2] (complex) -> float32 [T, H, D].

    NOTE: interleaved pairs, not rotate-half: the GGUF q/k rows are permuted for this form (see
    gguf_loader); for random weights both forms are equally valid. A pair is a complex number, so
    the rotation is one complex multiply.
    """
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [T, H, D/2]
    return torch.view_as_real(pairs * rot[:, None, :]).flatten(-2)


def _causal_mask(t: int, start_pos: int, device) -> torch.Tensor:
    """bool [T, start_pos + T]: query i sees keys j <= start_pos + i."""
    rows = torch.arange(t, device=device)[:, None] + start_pos
    return torch.arange(start_pos + t, device=device)[None, :] <= rows


class LlamaModel:
    """Llama forward over a `PagedKVCache`.

    backend "triton": INT4 linears through `int4_linear`, K/V store and decode attention through the
    Triton kernels. backend "torch": torch references, and INT4 weights dequantized once to float32
    (cached) so every linear is one dense GEMM.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, backend: str = "torch",
                 act_dtype: torch.dtype | None = None):
        check_choice("backend", backend, BACKENDS)
        self.config, self.backend = config, backend
        self.device = weights.embedding.device
        self.act_dtype = act_dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.embedding, self.final_norm = weights.embedding, weights.final_norm
        self.output = self._prepare(weights.output)
        self.layers = [self._prepare_layer(lw) for lw in weights.layers]
        self.rot = rope_table(config, self.device)  # [max_context, head_dim // 2]
        self.sm_scale = config.head_dim ** -0.5

    def _prepare(self, w: Linear) -> Linear:
        # NOTE: the torch backend dequantizes each INT4 matrix ONCE (dequantize_int4, float32) and
        # keeps the float matrix: y = x @ W.T is then exactly int4_linear_ref's math, without
        # re-expanding the nibbles at every step (the CPU fast path).
        if isinstance(w, Int4Weight) and self.backend == "torch":
            return w.dequantize()
        return w

    def _prepare_layer(self, lw) -> _Layer:
        # NOTE: fusing q/k/v and gate/up is exact (row concatenation, INT4 included) and halves the
        # number of GEMMs per block.
        return _Layer(attn_norm=lw.attn_norm, wqkv=self._prepare(concat_rows([lw.wq, lw.wk, lw.wv])),
                      wo=self._prepare(lw.wo), ffn_norm=lw.ffn_norm,
                      w_gate_up=self._prepare(concat_rows([lw.w_gate, lw.w_up])), w_down=self._prepare(lw.w_down))

    def linear(self, x: torch.Tensor, w: Linear, ride=None) -> torch.Tensor:
        """y [M, N] = x [M, K] @ W.T in the activation dtype.

        ``ride``: a verdict ride for the forward's last all-reduce; a single-process model has none (TP:
        ``TPLlamaModel.linear``)."""
        if ride is not None:
            raise RuntimeError(f"{type(self).__name__}: the verdict ride found no all-reduce to board")
        if isinstance(w, Int4Weight):
            from faultlab.engine.kernels.int4_gemm import int4_linear

            return int4_linear(x, w.qweight, w.scales, w.mins, w.group_size).to(self.act_dtype)
        return F.linear(x.to(w.dtype), w).to(self.act_dtype)

    # ---- shared pieces -------------------------------------------------------------------------

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens].to(self.act_dtype)  # [T, hidden]

    def _qkv(self, layer: _Layer, x: torch.Tensor, rot: torch.Tensor):
        """q [T, Hq, D], k/v [T, Hkv, D] of x [T, hidden], RoPE by rot [T, D/2] applied."""
        c = self.config
        h = rms_norm(x, layer.attn_norm, c.rms_eps)
        heads = self.linear(h, layer.wqkv).unflatten(-1, (-1, c.head_dim))  # [T, Hq + 2 Hkv, D]
        n_qk = c.n_heads + c.n_kv_heads
        qk = apply_rope(heads[:, :n_qk], rot).to(heads.dtype)  # q and k in one pass
        return qk[:, :c.n_heads], qk[:, c.n_heads:], heads[:, n_qk:]

    def _mlp(self, layer: _Layer, x: torch.Tensor, ride=None) -> torch.Tensor:
        """``ride`` (the last layer's only): boards w_down's all-reduce, the forward's last one."""
        h = rms_norm(x, layer.ffn_norm, self.config.rms_eps)
        gate, up = self.linear(h, layer.w_gate_up).chunk(2, dim=-1)  # [T, ffn] each
        return self.linear(F.silu(gate) * up, layer.w_down, ride)

    def _ride_at(self, i: int, ctx: StepContext):
        """The context's verdict ride for layer ``i`` (the last layer's), else None."""
        return ctx.ride if i == len(self.layers) - 1 else None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.final_norm, self.config.rms_eps)
        return self.linear(h, self.output).float()  # [T, vocab]

    def _check_positions(self, last: int) -> None:
        if last >= self.config.max_context:
            raise ValueError(f"position {last} is past max_context {self.config.max_context}")

    # ---- prefill -------------------------------------------------------------------------------

    def _prefill_attention(self, q, k, v, start_pos: int) -> torch.Tensor:
        """Causal GQA of q [T, Hq, D] over k/v [S, Hkv, D] (S = start_pos + T) -> [T, Hq * D]."""
        t, hkv = q.shape[0], k.shape[1]
        g = q.shape[1] // hkv
        qh = q.unflatten(1, (hkv, g)).permute(1, 2, 0, 3)  # [Hkv, G, T, D]
        kh = k.permute(1, 0, 2)[:, None].expand(-1, g, -1, -1)  # [Hkv, G, S, D]
        vh = v.permute(1, 0, 2)[:, None].expand(-1, g, -1, -1)
        if start_pos == 0:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.sm_scale)
        else:
            mask = _causal_mask(t, start_pos, q.device)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.sm_scale)
        return out.permute(2, 0, 1, 3).flatten(1)  # [T, Hq * D]

    def _prefill_layer(self, i: int, x, rot, kv: PagedKVCache, ctx: StepContext, res_slots):
        layer, start_pos = self.layers[i], ctx.start
        q, k, v = self._qkv(layer, x, rot)
        kv.store(i, k, v, ctx.slots, res_slots)
        if start_pos > 0:  # the cached prefix, dequantized from the pages
            k_old, v_old = kv.gather(i, ctx.page_row, start_pos, ctx)
            k = torch.cat([k_old.to(k.dtype), k])
            v = torch.cat([v_old.to(v.dtype), v])
        x = x + self.linear(self._prefill_attention(q, k, v, start_pos), layer.wo)
        return x + self._mlp(layer, x, self._ride_at(i, ctx))

    def _prefill(self, tokens: torch.Tensor, kv: PagedKVCache, ctx: StepContext, last_only: bool) -> torch.Tensor:
        t, start_pos = tokens.shape[0], ctx.start
        self._check_positions(start_pos + t - 1)
        rot = self.rot[start_pos:start_pos + t]  # [T, D/2]
        x = self._embed(tokens)
        res_slots = kv.residual_slots(ctx)
        for i in range(len(self.layers)):
            x = self._prefill_layer(i, x, rot, kv, ctx, res_slots)
        return self._logits(x[-1:] if last_only else x)

    # ---- decode --------------------------------------------------------------------------------

    def _decode(self, tokens: torch.Tensor, kv: PagedKVCache, ctx: StepContext) -> torch.Tensor:
        positions = ctx.positions
        if positions.device.type == "cpu":  # no host sync on an accelerator
            self._check_positions(int(positions.max()))
        seq_lens = ctx.seq_lens
        plan = kv.decode_plan(ctx)  # shared by every layer
        res_slots = kv.residual_slots(ctx)
        rot, x = self.rot[positions], self._embed(tokens)  # [B, D/2], [B, hidden]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rot)
            kv.store(i, k, v, ctx.slots, res_slots)
            attn = kv.decode_attention(i, q, ctx.block, seq_lens, self.sm_scale, plan)  # [B, Hq, D]
            x = x + self.linear(attn.reshape(attn.shape[0], -1).to(self.act_dtype), layer.wo)
            x = x + self._mlp(layer, x, self._ride_at(i, ctx))
        return self._logits(x)

    # ---- entry points --------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, kv: PagedKVCache, ctx: StepContext, *,
                last_only: bool = False) -> torch.Tensor:
        """One forward of tokens [T] over ``kv`` as ``ctx`` describes it -> logits float32.

        Prefill context: positions ``ctx.start..`` of one request; positions < start are read from ``kv``
        through its page row, the new K/V are stored at ``ctx.slots`` and attended with their fresh
        (unquantized) values, causally; logits [T, vocab] (``last_only``: [1, vocab]). Decode context:
        one token per request, K/V stored at ``ctx.slots``, then paged decode attention over ``ctx.block``
        up to each position; logits [B, vocab]. ``ctx.rows`` address a KV residual; ``ctx.ride`` boards
        the forward's last all-reduce (TP).
        """
        if ctx.is_prefill:
            return self._prefill(tokens, kv, ctx, last_only)
        return self._decode(tokens, kv, ctx)
