"""The paged KV cache: per-layer K/V page pools (page 0 = scratch, guard pages after the pool).

Its parts: ``residual.py`` (the KV residual's layout), ``kv_torch.py`` (the torch backend: store and
attention as batched torch ops); the Triton backend is ``faultlab.engine.kernels``. A forward's per-step
state (write slots, page table, request rows) comes in a ``StepContext`` (context.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from .choices import check_choice
from .context import StepContext
from .kv_torch import (DecodePlan, attend, batched_decode_attention, decode_plan, dequantize,  # noqa: F401
                       fp8_table, quantize, raw_bytes, store_kv_torch, with_residual)
from .kv_torch import RESIDUAL_SCALE
from .residual import RESIDUAL_SINK, RESIDUAL_WINDOW, ResidualLayout  # noqa: F401  (re-exported)

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
BACKENDS = ("torch", "triton")
_GARBAGE_SEED = 0x5C7A  # seeds the noise written into scratch and guard pages


def _kernel(module: str, name: str):
    """A Triton launcher of `faultlab.engine.kernels.<module>`."""
    import importlib

    return getattr(importlib.import_module(f"faultlab.engine.kernels.{module}"), name)


def hadamard(d: int, device=None) -> torch.Tensor:
    """float32 [d, d]: the orthonormal Sylvester Hadamard matrix (d a power of 2); symmetric, its own inverse."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-2 head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / d ** 0.5).to(torch.float32).to(device)


def _per_layer(value: float | Sequence[float], n_layers: int, what: str) -> list[float]:
    values = [float(value)] * n_layers if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n_layers or any(not v > 0 for v in values):
        raise ValueError(f"{what} must be a positive float or {n_layers} positive floats, got {value!r}")
    return values


class PagedKVCache:
    """K/V pages for every layer, in the layout of docs/structures.md.

    Per layer `k[layer], v[layer]: [num_pages + 1 + guard_pages, page_size, n_kv_heads, head_dim]`.
    Page 0 is scratch and pages past `num_pages` are guard pages; both hold seeded garbage.
    FP8 stores `(x / scale)` with one scalar scale per layer for K and one for V.

    `rotate_k` (opt-in; head_dim a power of 2) stores every K head vector rotated by the
    orthonormal Hadamard matrix H: pages hold `k @ H`, decode attention scores `(q @ H) . (k @ H)
    = q . k`, and `gather` returns `k @ H @ H = k`. Exact in real arithmetic; in e4m3 it spreads
    RoPE'd K's outlier channels over the whole head, which cuts SmolLM2's FP8 KL by 40%. Off by
    default: the rotation runs as separate torch ops around the kernels and costs decode time
    (docs/structures.md, "FP8 KV layout", has both measurements).

    `residual` (opt-in, FP8 only; a `ResidualLayout`) gives each request row residual pages that
    hold a second e4m3 byte of K and V for its first and its most recent pages, read back at about
    BF16 precision: `k_res[layer], v_res[layer]: [layout.num_pages, page_size, n_kv_heads, head_dim]`. A forward's
    `StepContext` addresses them by its request rows (`decode_plan(ctx)`, `residual_slots(ctx)`, `gather(..., ctx)`).
    """

    def __init__(self, n_layers: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 dtype: str = "bf16", device="cpu", backend: str = "torch", guard_pages: int = 4,
                 k_scale: float | Sequence[float] = 1.0, v_scale: float | Sequence[float] = 1.0,
                 buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                 rotate_k: bool = False, residual: ResidualLayout | None = None):
        check_choice("kv dtype", dtype, KV_DTYPES)
        if residual is not None and (dtype != "fp8" or residual.page_size != page_size):
            raise ValueError(f"residual needs an fp8 cache and the cache's page size {page_size}; got "
                             f"{dtype}, page size {residual.page_size}")
        check_choice("backend", backend, BACKENDS)
        if num_pages < 1 or page_size < 1 or guard_pages < 0:
            raise ValueError(f"need num_pages >= 1, page_size >= 1, guard_pages >= 0; got "
                             f"{num_pages}, {page_size}, {guard_pages}")
        self.n_layers, self.num_pages, self.page_size = n_layers, num_pages, page_size
        self.n_kv_heads, self.head_dim, self.guard_pages = n_kv_heads, head_dim, guard_pages
        self.dtype, self.torch_dtype, self.backend = dtype, KV_DTYPES[dtype], backend
        self.device = torch.device(device)
        # NOTE: per-layer scalar scales, the granularity of SGLang's MHATokenToKVPool. e4m3 precision
        # is relative (3 mantissa bits at any magnitude), so the scale only has to keep |x| / scale
        # inside the e4m3 range (448) and above its subnormals; 1.0 suits typical Llama K/V.
        # The kernels ignore the scales of BF16/FP32 caches, and so does `gather`.
        self.k_scale = _per_layer(k_scale, n_layers, "k_scale")
        self.v_scale = _per_layer(v_scale, n_layers, "v_scale")
        shape = (num_pages + 1 + guard_pages, page_size, n_kv_heads, head_dim)
        if buffers is None:
            buffers = ([torch.zeros(shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)],
                       [torch.zeros(shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)])
        self.k, self.v = _checked_buffers(buffers, n_layers, shape, self.torch_dtype)
        self._fill_garbage()
        self.rotate_k = bool(rotate_k)
        self.k_rotation = hadamard(head_dim, self.device) if self.rotate_k else None  # [D, D]
        self.residual = residual
        self.k_res: list[torch.Tensor] = []
        self.v_res: list[torch.Tensor] = []
        if residual is not None:
            res_shape = (residual.num_pages, page_size, n_kv_heads, head_dim)
            self.k_res = [torch.zeros(res_shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)]
            self.v_res = [torch.zeros(res_shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)]
            # the first logical page of each row eligible for the ring (KV cache state, set on admission)
            self.res_window_start = torch.zeros(residual.rows + 1, dtype=torch.long, device=self.device)
        # FP8 decode tables (torch backend) of each layer's scales: built by _scale_tables
        self._k_tables: list[torch.Tensor | None] = [None] * n_layers
        self._v_tables: list[torch.Tensor | None] = [None] * n_layers
        self._k_res_tables: list[torch.Tensor | None] = [None] * n_layers
        self._v_res_tables: list[torch.Tensor | None] = [None] * n_layers
        for layer in range(n_layers):
            self._scale_tables(layer)

    def scales(self, layer: int) -> tuple[float, float]:
        """`layer`'s (K, V) scales (FP8 stores x / scale; BF16/FP32 caches ignore them)."""
        return self.k_scale[layer], self.v_scale[layer]

    def set_scales(self, layer: int, k_scale: float, v_scale: float) -> None:
        """Replace `layer`'s (K, V) scales: every later write and read of the layer uses them, pages
        written before included (what a pool that lost its FP8 scales does)."""
        k_scale, v_scale = _per_layer(k_scale, 1, "k_scale")[0], _per_layer(v_scale, 1, "v_scale")[0]
        self.k_scale[layer], self.v_scale[layer] = k_scale, v_scale
        self._scale_tables(layer)

    def _scale_tables(self, layer: int) -> None:
        """The FP8 decode tables of `layer`'s scales (and of its residual's, if the cache keeps one)."""
        if self.dtype != "fp8":
            return
        k, v = self.scales(layer)
        self._k_tables[layer], self._v_tables[layer] = fp8_table(k, self.device), fp8_table(v, self.device)
        if self.residual is not None:
            self._k_res_tables[layer] = fp8_table(k / RESIDUAL_SCALE, self.device)
            self._v_res_tables[layer] = fp8_table(v / RESIDUAL_SCALE, self.device)

    def _fill_garbage(self) -> None:
        """Seeded noise in page 0 and the guard pages: reading them visibly corrupts attention."""
        gen = torch.Generator(device=self.device).manual_seed(_GARBAGE_SEED)
        outside = [0, *range(self.num_pages + 1, self.num_pages + 1 + self.guard_pages)]
        for cache in (*self.k, *self.v):
            noise = torch.randn((len(outside), *cache.shape[1:]), generator=gen, device=self.device) * 4.0
            raw_bytes(cache)[outside] = quantize(noise, cache.dtype, 1.0)

    @classmethod
    def over_buffers(cls, k: list[torch.Tensor], v: list[torch.Tensor], dtype: str, *, backend: str = "torch",
                     guard_pages: int = 4, k_scale: float | Sequence[float] = 1.0,
                     v_scale: float | Sequence[float] = 1.0, rotate_k: bool = False,
                     residual: ResidualLayout | None = None) -> "PagedKVCache":
        """A cache over existing per-layer K/V tensors (no copy), e.g. views of SGLang's MHATokenToKVPool.

        Each tensor is `[num_pages + 1 + guard_pages, page_size, n_kv_heads, head_dim]` of the dtype's
        torch type; page 0 and the guard pages are overwritten with the usual seeded garbage.
        """
        pages, page_size, n_kv_heads, head_dim = k[0].shape
        return cls(len(k), pages - 1 - guard_pages, page_size, n_kv_heads, head_dim, dtype=dtype,
                   device=k[0].device, backend=backend, guard_pages=guard_pages, k_scale=k_scale,
                   v_scale=v_scale, buffers=(list(k), list(v)), rotate_k=rotate_k, residual=residual)

    @property
    def max_tokens(self) -> int:
        """Tokens the usable pages hold."""
        return self.num_pages * self.page_size

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return token_bytes(self.n_layers, self.n_kv_heads, self.head_dim, self.dtype)

    def reset_residual(self, row: int, window_start: int = 0) -> None:
        """On admission: zero a request row's residual pages (pages it never writes read as plain FP8)
        and set its first logical page eligible for the ring."""
        if self.residual is None:
            return
        self.res_window_start[row] = window_start
        per_row = self.residual.pages_per_row
        for res in (*self.k_res, *self.v_res):
            raw_bytes(res)[row * per_row:(row + 1) * per_row] = 0

    def _rows_of(self, ctx: StepContext | None, what: str) -> torch.Tensor:
        if ctx is None or ctx.rows is None:
            raise ValueError(f"this cache keeps a KV residual: {what} needs the step context's request rows")
        return ctx.rows

    def residual_slots(self, ctx: StepContext) -> torch.Tensor | None:
        """Residual write slots (long [T], -1 = none) of the context's tokens, each request as long as
        it is after the write; None when the cache keeps no residual."""
        if self.residual is None:
            return None
        self._rows_of(ctx, "a forward")
        rows = ctx.token_rows()
        return self.residual.write_slots(rows, ctx.positions, ctx.token_lens(), self.res_window_start[rows.long()])

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, n_layers: int, page_size: int, n_kv_heads: int,
                         head_dim: int, dtype: str, guard_pages: int = 4) -> int:
        """Usable pages that fit `budget_bytes` with scratch and guard pages included.

        Equal budgets give FP8 about twice the pages (tokens) of BF16.
        """
        check_choice("kv dtype", dtype, KV_DTYPES)
        page_bytes = page_size * token_bytes(n_layers, n_kv_heads, head_dim, dtype)
        pages = budget_bytes // page_bytes - 1 - guard_pages
        if pages < 1:
            raise ValueError(f"budget_bytes {budget_bytes} holds no usable page of {page_bytes} bytes "
                             f"(plus {1 + guard_pages} scratch/guard pages)")
        return int(pages)

    @staticmethod
    def residual_bytes(layout: ResidualLayout | None, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of a `residual` layout's pages over all layers (0 without one)."""
        return 0 if layout is None else layout.nbytes(n_layers, n_kv_heads, head_dim)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              res_slots: torch.Tensor | None = None) -> None:
        """Write k, v [T, Hkv, D] to flat slots [T] (long) of `layer`, quantizing to the cache dtype;
        with a KV residual, also to `res_slots` (from `residual_slots`)."""
        store = store_kv_torch if self.backend == "torch" else _kernel("kv_store", "store_kv")
        if self.k_rotation is not None:
            k = (k.float() @ self.k_rotation).to(k.dtype)  # the kernels take k and v in one dtype
        extra = {}
        if self.residual is not None:
            if res_slots is None:
                raise ValueError("this cache keeps a KV residual: store needs res_slots (residual_slots)")
            extra = {"k_res": self.k_res[layer], "v_res": self.v_res[layer], "res_slots": res_slots}
        store(k, v, self.k[layer], self.v[layer], slots, self.k_scale[layer], self.v_scale[layer], **extra)

    def decode_plan(self, ctx: StepContext) -> DecodePlan | None:
        """The per-step part of decode attention over the context's page table, to share between layers
        (None on "triton" without a KV residual)."""
        res_table = res_bounds = None
        block_table, seq_lens = ctx.block, ctx.seq_lens
        if self.residual is not None:
            rows = self._rows_of(ctx, "decode")
            window_start = self.res_window_start[rows.long()]
            res_table = self.residual.table(rows, block_table.shape[1], seq_lens, window_start)
            res_bounds = self.residual.bounds(seq_lens, window_start)
        if self.backend == "torch":
            plan = decode_plan(block_table, seq_lens, self.page_size)
            return DecodePlan(plan.pages, plan.mask, res_table, res_bounds)
        return None if res_table is None else DecodePlan(None, None, res_table, res_bounds)

    def decode_attention(self, layer: int, q: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float, plan: DecodePlan | None = None) -> torch.Tensor:
        """Paged decode attention of q [B, H, D] over `seq_lens` [B] tokens of block_table [B, P].

        `plan` (from `decode_plan` of the same block_table/seq_lens) skips recomputing it per layer.
        """
        if self.k_rotation is not None:
            q = (q.float() @ self.k_rotation).to(q.dtype)
        if self.residual is not None and plan is None:
            raise ValueError("this cache keeps a KV residual: decode_attention needs the step's decode_plan")
        if self.backend == "triton":
            kernel = _kernel("paged_attention", "paged_decode_attention")
            extra = {} if plan is None else {"k_res": self.k_res[layer], "v_res": self.v_res[layer],
                                             "res_table": plan.res_table, "res_bounds": plan.res_bounds,
                                             "res_max_tokens": self.residual.max_tokens}
            return kernel(q, self.k[layer], self.v[layer], block_table, seq_lens, sm_scale,
                          self.k_scale[layer], self.v_scale[layer], **extra)
        plan = plan or decode_plan(block_table, seq_lens, self.page_size)
        return attend(q, self.k[layer], self.v[layer], plan, self._k_tables[layer], self._v_tables[layer],
                       sm_scale, self._residual_of(layer))

    def _residual_of(self, layer: int) -> tuple | None:
        if self.residual is None:
            return None
        return self.k_res[layer], self.v_res[layer], self._k_res_tables[layer], self._v_res_tables[layer]

    def gather(self, layer: int, page_row: torch.Tensor, n_tokens: int,
               ctx: StepContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n_tokens` of one page row, dequantized: (k, v) float32 [n_tokens, Hkv, D].

        A KV residual needs the prefill's context (its request row and length, this forward's included)."""
        pages = page_row[:-(-n_tokens // self.page_size)].long()
        k = dequantize(raw_bytes(self.k[layer])[pages], self._k_tables[layer])  # [np, ps, Hkv, D]
        v = dequantize(raw_bytes(self.v[layer])[pages], self._v_tables[layer])
        if self.residual is not None:
            row = self._rows_of(ctx, "gather")[0].long()
            logical = torch.arange(pages.numel(), device=pages.device)
            res_pages = self.residual.pages(row, logical, ctx.seq_lens[0], self.res_window_start[row])
            k = with_residual(k, self.k_res[layer], res_pages, self._k_res_tables[layer])
            v = with_residual(v, self.v_res[layer], res_pages, self._v_res_tables[layer])
        k, v = k.flatten(0, 1)[:n_tokens], v.flatten(0, 1)[:n_tokens]
        if self.k_rotation is not None:
            k = k @ self.k_rotation  # H is its own inverse
        return k, v


def _checked_buffers(buffers, n_layers: int, shape: tuple, dtype: torch.dtype):
    """(k, v) per-layer lists, each tensor of ``shape`` and ``dtype``; ValueError naming the bad one."""
    k, v = (list(b) for b in buffers)
    for name, layers in (("k", k), ("v", v)):
        if len(layers) != n_layers:
            raise ValueError(f"buffers: {len(layers)} {name} tensors for {n_layers} layers")
        for i, t in enumerate(layers):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"buffers: {name}[{i}] is {tuple(t.shape)} {t.dtype}, need {shape} {dtype}")
    return k, v


def token_bytes(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str) -> int:
    """K and V bytes of one token over all layers for a cache dtype name."""
    check_choice("kv dtype", dtype, KV_DTYPES)
    return 2 * n_layers * n_kv_heads * head_dim * KV_DTYPES[dtype].itemsize
