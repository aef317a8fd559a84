"""How much an FP8 KV cache changes the model: next-token agreement and KL against a BF16 KV cache.

Teacher-forced over real English text (the stdlib's `pydoc_data.topics`): each window is fed in
chunks through `prefill`, the earlier chunks read back from the paged cache, so the cache dtype is
what differs between the two runs (same INT4 weights, same activations).
"""
from __future__ import annotations

import functools
import math

import torch

from faultlab.engine.context import StepContext
from faultlab.engine.kvcache import RESIDUAL_SINK, RESIDUAL_WINDOW, PagedKVCache, ResidualLayout
from faultlab.engine.model import LlamaModel


@functools.lru_cache(maxsize=4)
def english_tokens(n_tokens: int, model_name: str = "smollm2") -> tuple[int, ...]:
    """At least `n_tokens` token ids of the stdlib language reference (topics in sorted order).

    Topics are tokenized one by one (each followed by a blank line) until there are enough.
    """
    from pydoc_data.topics import topics

    tokenizer, ids = _tokenizer(model_name), []
    for name in sorted(topics):
        ids += tokenizer.encode(topics[name].strip() + "\n\n")
        if len(ids) >= n_tokens:
            return tuple(ids)
    raise ValueError(f"n_tokens {n_tokens} is more than the {len(ids)} tokens of pydoc_data.topics")


TEXT_MODELS = ("smollm2",)  # the presets with a tokenizer (real text to read): eval-kv and `faultlab generate`


def check_text_model(where: str, name: str, error: type[Exception] = ValueError) -> str:
    """``name`` if it is one of TEXT_MODELS; else ``error`` naming ``where``."""
    if name not in TEXT_MODELS:
        raise error(f"{where} {name!r} is not valid; this command needs a model with a tokenizer: "
                    f"{list(TEXT_MODELS)}")
    return name


def _check_model(model_name: str) -> None:
    check_text_model("model_name", model_name)


def _tokenizer(model_name: str):
    from faultlab.engine.gguf_loader import load_tokenizer

    _check_model(model_name)
    return load_tokenizer()


def _load(model_name: str, weight_dtype: str, device: str):
    from faultlab.engine.gguf_loader import load_smollm2

    _check_model(model_name)
    return load_smollm2(weight_dtype, device)


def _page_row(n_tokens: int, page_size: int, device) -> torch.Tensor:
    return torch.arange(1, -(-n_tokens // page_size) + 1, dtype=torch.int32, device=device)  # [P]


def _window_logits(model: LlamaModel, tokens: torch.Tensor, kv_dtype: str, chunk: int, page_size: int,
                   rotate_k: bool = False, residual: ResidualLayout | None = None, head: int = 0,
                   window_start: int = 0):
    """Logits float32 [T, V] of one window fed into a fresh cache of `kv_dtype` (one request, row 0):
    its first `head` tokens (at least `chunk`) in one piece, then chunk by chunk. `window_start`: the
    residual ring's first page (PagedKVCache.reset_residual)."""
    c, device = model.config, tokens.device
    page_row = _page_row(tokens.numel(), page_size, device)
    kv = PagedKVCache(c.n_layers, page_row.numel(), page_size, c.n_kv_heads, c.head_dim, kv_dtype,
                      device, model.backend, rotate_k=rotate_k, residual=residual)
    kv.reset_residual(0, window_start=window_start)
    pos = torch.arange(tokens.numel(), device=device)
    slots = page_row[pos // page_size].long() * page_size + pos % page_size  # [T]
    head = max(head, chunk)
    starts = [0, *range(head, tokens.numel(), chunk)]
    ends = [*starts[1:], tokens.numel()]
    out = [model.forward(tokens[s:e], kv, StepContext.for_prefill(s, slots[s:e], page_row, row=0))
           for s, e in zip(starts, ends)]
    return torch.cat(out)


def _compare(ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Sums over the rows [T, V]: top-1 matches, KL(ref || test) in nats (and its max), and the
    negative log-likelihoods of targets [T - 1] (the next tokens of rows 0..T-2) under each."""
    ref_lp, test_lp = ref_logits.double().log_softmax(-1), test_logits.double().log_softmax(-1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1).clamp_min(0.0)  # [T]
    rows = torch.arange(targets.numel())
    return {"agree": int((ref_logits.argmax(-1) == test_logits.argmax(-1)).sum()), "kl": float(kl.sum()),
            "max_kl": float(kl.max()), "nll_ref": -float(ref_lp[rows, targets].sum()),
            "nll_test": -float(test_lp[rows, targets].sum()), "n_nll": targets.numel()}


def _windows(n_positions: int, window: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of consecutive windows that count n_positions positions after their first `chunk`
    tokens."""
    spans, start, left = [], 0, n_positions
    while left > 0:
        length = min(window, chunk + left)
        spans.append((start, length))
        start, left = start + length, left - (length - chunk)
    return spans


def eval_kv(model_name: str = "smollm2", n_positions: int = 2000, *, window: int = 512, chunk: int = 32,
            page_size: int = 16, ref_kv: str = "bf16", test_kv: str = "fp8", weight_dtype: str = "int4",
            backend: str = "torch", device: str = "cpu", rotate_k: bool = False, residual: bool = False,
            residual_sink: int = RESIDUAL_SINK, residual_window: int = RESIDUAL_WINDOW, prompt: int = 0) -> dict:
    """Compare a `test_kv` (FP8) with a `ref_kv` (BF16) KV cache over `n_positions` next-token positions.

    `rotate_k` turns on the test cache's Hadamard K rotation, `residual` its KV residual for each
    window's first `residual_sink` and last `residual_window` tokens (`PagedKVCache`); the reference
    cache has neither. `prompt` > 0: the first `prompt` tokens of each window are a prompt, prefilled in
    one piece (fresh K/V, the same in both caches) and not counted; the residual ring skips the prompt
    pages the prefix cache could share, as in the engine. This measures decoding right after a prompt;
    the default measures a long generation (every earlier token in the ring's reach).
    Returns {"positions", "top1_agreement", "mean_kl", "max_kl", "ppl_ref", "ppl_test"}: KL(p_ref || p_test)
    in nats per position, and the perplexity of the text under each cache (for scale).
    """
    head = max(chunk, prompt)
    if n_positions < 1 or chunk < 1 or window <= head:
        raise ValueError(f"need n_positions >= 1, chunk >= 1 and window > max(chunk, prompt); got {n_positions}, "
                         f"{chunk}, {window}, {prompt}")
    config, weights, _ = _load(model_name, weight_dtype, device)
    model = LlamaModel(config, weights, backend=backend, act_dtype=torch.float32)
    spans = _windows(n_positions, window, head)
    window_start = (prompt - 1) // page_size if prompt else 0  # the engine's first non-shareable page
    layout = ResidualLayout.of(1, page_size, residual_sink, residual_window) if residual else None
    text = torch.tensor(english_tokens(sum(n for _, n in spans), model_name), device=device)
    totals: dict = {}
    for start, length in spans:
        tokens = text[start:start + length]
        # NOTE: the first chunk of a window attends to its own fresh K/V only, identical for both
        # caches, so it is left out of the counts (it would inflate the agreement).
        ref = _window_logits(model, tokens, ref_kv, chunk, page_size, head=head)[head:]
        test = _window_logits(model, tokens, test_kv, chunk, page_size, rotate_k, layout, head, window_start)[head:]
        for key, value in _compare(ref, test, tokens[head + 1:]).items():
            totals[key] = max(totals.get(key, 0.0), value) if key == "max_kl" else totals.get(key, 0) + value
    return {"positions": n_positions, "window": window, "prompt": prompt, "test_kv": test_kv, "ref_kv": ref_kv,
            "rotate_k": rotate_k, "residual": None if layout is None else
            {"sink_tokens": residual_sink, "window_tokens": residual_window}, "top1_agreement": totals["agree"] / n_positions,
            "mean_kl": totals["kl"] / n_positions, "max_kl": totals["max_kl"],
            "ppl_ref": math.exp(totals["nll_ref"] / totals["n_nll"]),
            "ppl_test": math.exp(totals["nll_test"] / totals["n_nll"])}


def main() -> None:
    """`python -m faultlab.engine.evalkv [n_positions]`: print the comparison as JSON."""
    import json
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(json.dumps(eval_kv(n_positions=n), indent=2))


if __name__ == "__main__":
    main()
