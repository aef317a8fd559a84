"""The paged KV cache: per-layer K/V page pools (page 0 = scratch, guard pages after the pool)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .kernels.kv_store import FP8_MAX, RES_SCALE as RESIDUAL_SCALE  # written once, beside the kernel

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
BACKENDS = ("torch", "triton")
_GARBAGE_SEED = 0x5C7A  # seeds the noise written into scratch and guard pages
RESIDUAL_SINK, RESIDUAL_WINDOW = 16, 128  # default tokens with a residual: first (sink), most recent


def _kernel(module: str, name: str):
    """A Triton launcher of `faultlab.engine.kernels.<module>`."""
    import importlib

    return getattr(importlib.import_module(f"faultlab.engine.kernels.{module}"), name)


@dataclass(frozen=True)
class ResidualLayout:
    """Which KV pages of a request keep a residual byte, and where the residual lives.

    FP8 K/V have 3 mantissa bits; a second e4m3 byte per element, the residual `(y - e4m3(y)) * 16`,
    brings a page back to about BF16 precision. Each request row owns `pages_per_row` residual pages:
    `sink_pages` for its first logical pages (the attention sink) and a ring of `ring_pages` for its
    most recent ones. At length L (tokens, the one being written or read included) logical page j has
    a residual iff j < sink_pages, or window_start <= j and cur - ring_pages < j <= cur, with
    cur = (L - 1) // page_size and `window_start` the row's first page eligible for the ring (the engine
    sets it past the prompt pages the prefix cache could share, so that a request's numerics do not
    depend on cache hits). Ring page j lives in slot sink_pages + j % ring_pages, so a page leaves the
    ring exactly when the page that overwrites its slot starts. Row `rows` is scratch (CUDA-graph
    padding rows use it). Rows are zeroed on admission: a page nobody wrote a residual for reads 0.
    """

    rows: int
    page_size: int
    sink_pages: int
    ring_pages: int

    @classmethod
    def of(cls, rows: int, page_size: int, sink_tokens: int = RESIDUAL_SINK,
           window_tokens: int = RESIDUAL_WINDOW) -> "ResidualLayout":
        """At least `sink_tokens` first and `window_tokens` most recent tokens of each request."""
        if rows < 1 or sink_tokens < 0 or window_tokens < 1:
            raise ValueError(f"KV residual: need rows >= 1, sink_tokens >= 0, window_tokens >= 1; got "
                             f"{rows}, {sink_tokens}, {window_tokens}")
        return cls(rows, page_size, -(-sink_tokens // page_size), -(-window_tokens // page_size) + 1)

    @property
    def pages_per_row(self) -> int:
        return self.sink_pages + self.ring_pages

    @property
    def max_tokens(self) -> int:
        """The most tokens of one request that can have a residual at once (the kernel's res_max_tokens)."""
        return self.pages_per_row * self.page_size

    @property
    def num_pages(self) -> int:
        """Residual pages in all, the scratch row's included."""
        return (self.rows + 1) * self.pages_per_row

    def pages(self, rows: torch.Tensor, logical: torch.Tensor, lengths: torch.Tensor,
              window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """Residual page (long) of logical page `logical` of row `rows` at `lengths` tokens, -1 if none
        (arguments broadcast)."""
        cur = torch.div(lengths - 1, self.page_size, rounding_mode="floor")
        sink = logical < self.sink_pages
        recent = (logical > cur - self.ring_pages) & (logical <= cur) & (logical >= window_start)
        slot = torch.where(sink, logical, self.sink_pages + logical % self.ring_pages)
        return torch.where(sink | recent, rows.long() * self.pages_per_row + slot, -1)

    def table(self, rows: torch.Tensor, width: int, lengths: torch.Tensor,
              window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """int32 [B, width]: the residual page of each logical page of rows [B] at lengths [B] (window_start
        [B] or one int), or -1."""
        logical = torch.arange(width, device=rows.device)[None, :]
        if isinstance(window_start, torch.Tensor):
            window_start = window_start[:, None]
        return self.pages(rows[:, None], logical, lengths[:, None], window_start).to(torch.int32)

    def bounds(self, lengths: torch.Tensor, window_start: torch.Tensor) -> torch.Tensor:
        """int32 [B, 2]: (a, c) per request at lengths [B]: only tokens < a (the sink) or >= c (the ring)
        can have a residual (the attention kernel's `res_bounds`)."""
        cur = torch.div(lengths - 1, self.page_size, rounding_mode="floor")
        ring_lo = torch.maximum(window_start, cur - self.ring_pages + 1)
        sink = torch.full_like(ring_lo, self.sink_pages * self.page_size)
        return torch.stack([sink, ring_lo * self.page_size], dim=1).to(torch.int32)

    def write_slots(self, rows: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                    window_start: torch.Tensor | int = 0) -> torch.Tensor:
        """long [T]: the residual slot of tokens at positions [T] of rows [T] when the request is
        `lengths` [T] tokens long after the write; -1 where the token's page keeps no residual."""
        ps = self.page_size
        page = self.pages(rows, torch.div(positions, ps, rounding_mode="floor"), lengths, window_start)
        return torch.where(page >= 0, page * ps + positions % ps, -1)


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """What decode attention needs from (block_table, seq_lens, rows), computed once per step."""

    pages: torch.Tensor | None  # long [B, np]: pages of each row's live tokens, scratch 0 past them (torch)
    mask: torch.Tensor | None  # bool [B, 1, 1, np * page_size]: token j of row b is live (torch)
    res_table: torch.Tensor | None = None  # int32 [B, P]: residual page per logical page, -1 = none
    res_bounds: torch.Tensor | None = None  # int32 [B, 2]: only tokens < [:, 0] or >= [:, 1] have one


def decode_plan(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> DecodePlan:
    """Cut block_table [B, P] to the longest row; entries past a row's own length become scratch 0."""
    n_pages = -(-int(seq_lens.max()) // page_size)
    pages = block_table[:, :n_pages].long()  # [B, np]
    live = torch.arange(n_pages, device=pages.device) < (seq_lens[:, None] + page_size - 1) // page_size
    tokens = torch.arange(n_pages * page_size, device=pages.device) < seq_lens[:, None]  # [B, n]
    return DecodePlan(torch.where(live, pages, 0), tokens[:, None, None, :])


def fp8_table(scale: float, device) -> torch.Tensor:
    """float32 [256]: the value of every e4m3 byte times `scale`."""
    codes = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    return codes.float() * scale


def hadamard(d: int, device=None) -> torch.Tensor:
    """float32 [d, d]: the orthonormal Sylvester Hadamard matrix (d a power of 2); symmetric, its own inverse."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-2 head_dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / d ** 0.5).to(torch.float32).to(device)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The tensor to index: FP8 caches as their uint8 bytes (index/index_put lack fp8 on some devices)."""
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def dequantize(x: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
    """Cache contents (FP8 as fp8 or as its uint8 bytes) -> float32; FP8 is `x.float() * scale`
    through `table = fp8_table(scale)`."""
    if x.dtype not in (torch.float8_e4m3fn, torch.uint8):
        return x.float()
    # NOTE: looking every byte up in a 256-entry table gives the same bits as `x.float() * scale`
    # (NaN included) and is ~2.5x faster on a CPU than torch's fp8 cast.
    return torch.take(table, x.view(torch.uint8).long())


def _with_residual(x: torch.Tensor, res: torch.Tensor, res_pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x float32 [..., page_size, Hkv, D] plus the residual of res_pages [...] (long, -1 = none: plus 0),
    dequantized through `table` (fp8_table(scale / RESIDUAL_SCALE))."""
    values = dequantize(_raw(res)[res_pages.clamp_min(0)], table)
    return x + torch.where((res_pages >= 0).view(*res_pages.shape, 1, 1, 1), values, 0.0)


def _attend(q, k_cache, v_cache, plan: DecodePlan, k_table, v_table, sm_scale: float,
            residual: tuple | None = None) -> torch.Tensor:
    """`residual`: (k_res, v_res, k_res_table, v_res_table) when plan.res_table is set."""
    b, h, d = q.shape
    hkv = k_cache.shape[2]
    k = dequantize(_raw(k_cache)[plan.pages], k_table)  # [B, np, ps, Hkv, D]
    v = dequantize(_raw(v_cache)[plan.pages], v_table)
    if plan.res_table is not None:
        k_res, v_res, k_res_table, v_res_table = residual
        res_pages = plan.res_table[:, :plan.pages.shape[1]].long()  # [B, np]
        k = _with_residual(k, k_res, res_pages, k_res_table)
        v = _with_residual(v, v_res, res_pages, v_res_table)
    k = k.flatten(1, 2).transpose(1, 2)  # [B, Hkv, n, D]
    v = v.flatten(1, 2).transpose(1, 2)
    qh = q.float().reshape(b, hkv, h // hkv, d)  # [B, Hkv, G, D]: head i uses KV head i // G
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=plan.mask, scale=sm_scale)
    return out.reshape(b, h, d).to(q.dtype)


def batched_decode_attention(q, k_cache, v_cache, block_table, seq_lens, sm_scale, k_scale=1.0, v_scale=1.0):
    """`paged_decode_attention_ref`'s math (gather, dequantize, masked softmax), whole batch at once.

    q [B, H, D], caches [pages, page_size, Hkv, D], block_table int32 [B, P], seq_lens [B] >= 1
    -> out [B, H, D] in q's dtype. Reads exactly the pages the reference reads.
    """
    # NOTE: the reference loops over requests (a dozen small ops each); on a CPU that costs more than
    # the GEMMs at batch 16, so the torch backend pads to the longest row and masks instead.
    plan = decode_plan(block_table, seq_lens, k_cache.shape[1])
    return _attend(q, k_cache, v_cache, plan, fp8_table(k_scale, q.device), fp8_table(v_scale, q.device),
                   sm_scale)


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as the cache stores it (FP8 as uint8 bytes): `clamp(x / scale)` in e4m3, or a cast."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    x = x.float() if scale == 1.0 else x.float() / scale  # x / 1.0 == x: skip the division
    return x.clamp(-FP8_MAX, FP8_MAX).to(dtype).view(torch.uint8)


def store_kv_torch(k, v, k_cache, v_cache, slots, k_scale=1.0, v_scale=1.0, k_res=None, v_res=None,
                   res_slots=None) -> None:
    """`store_kv_ref`'s bits with one flat index_put per cache; k, v [T, Hkv, D], slots [T].

    With `k_res`/`v_res` (FP8 residual pages), tokens whose res_slots [T] is >= 0 also store their
    residual `e4m3((y - e4m3(y)) * RESIDUAL_SCALE)`, y = clamp(x / scale) (ResidualLayout).
    """
    for x, cache, scale, res in ((k, k_cache, k_scale, k_res), (v, v_cache, v_scale, v_res)):
        stored = _quantize(x, cache.dtype, scale)
        _raw(cache).view(-1, *cache.shape[2:])[slots] = stored  # [P * ps, Hkv, D]
        if res is not None:
            keep = res_slots >= 0
            y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
            residual = _quantize((y - stored.view(torch.float8_e4m3fn).float()) * RESIDUAL_SCALE, res.dtype, 1.0)
            _raw(res).view(-1, *res.shape[2:])[res_slots[keep]] = residual[keep]


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {list(valid)}")


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
    BF16 precision: `k_res[layer], v_res[layer]: [layout.num_pages, page_size, n_kv_heads, head_dim]`. Its forwards pass
    the request rows (`decode_plan(..., rows)`, `residual_slots`, `gather(..., row=, length=)`).
    """

    def __init__(self, n_layers: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int,
                 dtype: str = "bf16", device="cpu", backend: str = "torch", guard_pages: int = 4,
                 k_scale: float | Sequence[float] = 1.0, v_scale: float | Sequence[float] = 1.0,
                 buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                 rotate_k: bool = False, residual: ResidualLayout | None = None):
        _check_choice("kv dtype", dtype, KV_DTYPES)
        if residual is not None and (dtype != "fp8" or residual.page_size != page_size):
            raise ValueError(f"residual needs an fp8 cache and the cache's page size {page_size}; got "
                             f"{dtype}, page size {residual.page_size}")
        _check_choice("backend", backend, BACKENDS)
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
        fp8 = dtype == "fp8"
        self.rotate_k = bool(rotate_k)
        self.k_rotation = hadamard(head_dim, self.device) if self.rotate_k else None  # [D, D]
        self._k_tables = [fp8_table(x, self.device) if fp8 else None for x in self.k_scale]
        self._v_tables = [fp8_table(x, self.device) if fp8 else None for x in self.v_scale]
        self.residual = residual
        self.k_res: list[torch.Tensor] = []
        self.v_res: list[torch.Tensor] = []
        if residual is not None:
            res_shape = (residual.num_pages, page_size, n_kv_heads, head_dim)
            self.k_res = [torch.zeros(res_shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)]
            self.v_res = [torch.zeros(res_shape, dtype=self.torch_dtype, device=self.device) for _ in range(n_layers)]
            self._k_res_tables = [fp8_table(x / RESIDUAL_SCALE, self.device) for x in self.k_scale]
            self._v_res_tables = [fp8_table(x / RESIDUAL_SCALE, self.device) for x in self.v_scale]
            # the first logical page of each row eligible for the ring (KV cache state, set on admission)
            self.res_window_start = torch.zeros(residual.rows + 1, dtype=torch.long, device=self.device)

    def _fill_garbage(self) -> None:
        """Seeded noise in page 0 and the guard pages: reading them visibly corrupts attention."""
        gen = torch.Generator(device=self.device).manual_seed(_GARBAGE_SEED)
        outside = [0, *range(self.num_pages + 1, self.num_pages + 1 + self.guard_pages)]
        for cache in (*self.k, *self.v):
            noise = torch.randn((len(outside), *cache.shape[1:]), generator=gen, device=self.device) * 4.0
            _raw(cache)[outside] = _quantize(noise, cache.dtype, 1.0)

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

    @staticmethod
    def residual_bytes(layout: ResidualLayout | None, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
        """Bytes of a `residual` layout's pages over all layers (one FP8 byte per K and V element)."""
        if layout is None:
            return 0
        return 2 * layout.num_pages * layout.page_size * n_layers * n_kv_heads * head_dim

    def reset_residual(self, row: int, window_start: int = 0) -> None:
        """On admission: zero a request row's residual pages (pages it never writes read as plain FP8)
        and set its first logical page eligible for the ring."""
        if self.residual is None:
            return
        self.res_window_start[row] = window_start
        per_row = self.residual.pages_per_row
        for res in (*self.k_res, *self.v_res):
            _raw(res)[row * per_row:(row + 1) * per_row] = 0

    def residual_slots(self, rows: torch.Tensor | None, positions: torch.Tensor,
                       lengths: torch.Tensor) -> torch.Tensor | None:
        """Residual write slots (long [T], -1 = none) of tokens at positions [T] of rows [T], the
        request `lengths` [T] tokens long after the write; None when the cache keeps no residual."""
        if self.residual is None:
            return None
        if rows is None:
            raise ValueError("this cache keeps a KV residual: its forwards must pass the request rows")
        return self.residual.write_slots(rows, positions, lengths, self.res_window_start[rows.long()])

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, n_layers: int, page_size: int, n_kv_heads: int,
                         head_dim: int, dtype: str, guard_pages: int = 4) -> int:
        """Usable pages that fit `budget_bytes` with scratch and guard pages included.

        Equal budgets give FP8 about twice the pages (tokens) of BF16.
        """
        _check_choice("kv dtype", dtype, KV_DTYPES)
        page_bytes = page_size * token_bytes(n_layers, n_kv_heads, head_dim, dtype)
        pages = budget_bytes // page_bytes - 1 - guard_pages
        if pages < 1:
            raise ValueError(f"budget_bytes {budget_bytes} holds no usable page of {page_bytes} bytes "
                             f"(plus {1 + guard_pages} scratch/guard pages)")
        return int(pages)

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

    def decode_plan(self, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    rows: torch.Tensor | None = None) -> DecodePlan | None:
        """The per-step part of decode attention, to share between layers (None on "triton" without a
        KV residual). A KV residual needs the request rows [B] of block_table's rows."""
        res_table = res_bounds = None
        if self.residual is not None:
            if rows is None:
                raise ValueError("this cache keeps a KV residual: decode needs the request rows")
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
            attend = _kernel("paged_attention", "paged_decode_attention")
            extra = {} if plan is None else {"k_res": self.k_res[layer], "v_res": self.v_res[layer],
                                             "res_table": plan.res_table, "res_bounds": plan.res_bounds,
                                             "res_max_tokens": self.residual.max_tokens}
            return attend(q, self.k[layer], self.v[layer], block_table, seq_lens, sm_scale,
                          self.k_scale[layer], self.v_scale[layer], **extra)
        plan = plan or decode_plan(block_table, seq_lens, self.page_size)
        return _attend(q, self.k[layer], self.v[layer], plan, self._k_tables[layer], self._v_tables[layer],
                       sm_scale, self._residual_of(layer))

    def _residual_of(self, layer: int) -> tuple | None:
        if self.residual is None:
            return None
        return self.k_res[layer], self.v_res[layer], self._k_res_tables[layer], self._v_res_tables[layer]

    def gather(self, layer: int, page_row: torch.Tensor, n_tokens: int, *, row: int | None = None,
               length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n_tokens` of one page row, dequantized: (k, v) float32 [n_tokens, Hkv, D].

        A KV residual needs the request's `row` and its `length` (tokens, this forward's included)."""
        pages = page_row[:-(-n_tokens // self.page_size)].long()
        k = dequantize(_raw(self.k[layer])[pages], self._k_tables[layer])  # [np, ps, Hkv, D]
        v = dequantize(_raw(self.v[layer])[pages], self._v_tables[layer])
        if self.residual is not None:
            if row is None or length is None:
                raise ValueError("this cache keeps a KV residual: gather needs the request's row and length")
            logical = torch.arange(pages.numel(), device=pages.device)
            res_pages = self.residual.pages(torch.tensor(row, device=pages.device), logical,
                                            torch.tensor(length, device=pages.device), self.res_window_start[row])
            k = _with_residual(k, self.k_res[layer], res_pages, self._k_res_tables[layer])
            v = _with_residual(v, self.v_res[layer], res_pages, self._v_res_tables[layer])
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
    _check_choice("kv dtype", dtype, KV_DTYPES)
    return 2 * n_layers * n_kv_heads * head_dim * KV_DTYPES[dtype].itemsize
