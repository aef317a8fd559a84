"""A torch rotary-embedding op for SGLang 0.5.23 on a plain CPU device (test environment only).

SGLang's ``RotaryEmbedding.__init__`` (``sglang/srt/layers/rotary_embedding/base.py``) imports its
fallback op from ``vllm._custom_ops`` on every device that is neither CUDA, HIP nor one of SGLang's
named platforms. With ``device="cpu"`` and without ``SGLANG_USE_CPU_ENGINE=1`` (that path needs an
sgl-kernel CPU build) that is the branch taken, and vLLM is not installed here.

Why it lives here and how it reaches the scheduler process
------------------------------------------------------------
* Never in kvguard: kvguard does not depend on SGLang's CPU path.
* Not a fake ``vllm`` folder on ``PYTHONPATH``: that would be visible to every process and to every
  ``import vllm`` probe of the test run.
* :func:`install` puts two in-memory modules, ``vllm`` (an empty package) and ``vllm._custom_ops``
  (holding only :func:`rotary_embedding`), into ``sys.modules`` of the process it runs in. It is called
  by faultlab's SGLang plugin (:func:`faultlab.sglang_live.inject.register`) when
  ``FAULTLAB_SGLANG_CPU_ROTARY=1`` is set. SGLang's own loader (``load_plugins``) runs that plugin in
  every SGLang process, in the scheduler process before the model (and so the rotary layer) is built;
  the scheduler is spawned and inherits the variable from the test process that starts the engine.
  It does nothing when a real ``vllm`` is importable.

SGLang's other ``vllm`` imports (``vllm._custom_ops.rms_norm`` on HIP only, ``vllm.logger``,
``vllm.distributed``) are all inside ``try/except ImportError`` and still fail as before.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch

ENV_VAR = "FAULTLAB_SGLANG_CPU_ROTARY"


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """vLLM's ``rotary_embedding`` custom op, in place, in torch.

    ``cos_sin_cache`` is ``[max_position, rot_dim]`` (cos in the first half, sin in the second);
    ``query``/``key`` are ``[..., num_heads * head_size]`` or ``[..., num_heads, head_size]``; only the
    first ``rot_dim`` features of each head rotate. NeoX style rotates the two halves, GPT-J style the
    interleaved pairs.
    """
    pos = positions.reshape(-1).long()
    cos, sin = cos_sin_cache.index_select(0, pos).chunk(2, dim=-1)  # [T, rot_dim / 2] each
    rot = cos.shape[-1] * 2
    for x in (query, key):
        if x is None:
            continue
        view = x.view(pos.numel(), -1, head_size)
        part = view[..., :rot].float()
        c, s = cos[:, None, :].float(), sin[:, None, :].float()
        if is_neox:
            x1, x2 = part[..., : rot // 2], part[..., rot // 2:]
            out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        view[..., :rot] = out.to(view.dtype)


def install() -> bool:
    """Make ``from vllm._custom_ops import rotary_embedding`` resolve to :func:`rotary_embedding`.

    Returns False (and changes nothing) when a real vLLM is importable or the shim is already there.
    """
    if "vllm._custom_ops" in sys.modules:
        return False
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None:
        return False
    package = types.ModuleType("vllm", doc="faultlab's in-memory stand-in (rotary op only; tests)")
    package.__path__ = []
    package.__spec__ = importlib.machinery.ModuleSpec("vllm", None, is_package=True)
    ops = types.ModuleType("vllm._custom_ops", doc=__doc__)
    ops.__spec__ = importlib.machinery.ModuleSpec("vllm._custom_ops", None)
    ops.rotary_embedding = rotary_embedding
    package._custom_ops = ops
    sys.modules.setdefault("vllm", package)
    sys.modules["vllm._custom_ops"] = ops
    return True
