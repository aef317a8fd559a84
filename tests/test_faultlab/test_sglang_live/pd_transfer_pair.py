"""What both real-backend PD modules start their pair with: test_sglang_pd_transfer.py (kvguard on) and
test_sglang_pd_transfer_off.py (kvguard off, the same faults). The backends, the prompts, and each server's fault
settings (faultlab/sglang_live/pd_faults.py, faultlab/sglang_live/inject.py)."""
from __future__ import annotations

import os
import random

import pytest

NEW = 12
HOLD_S = 5.0
# backend: (the module it needs, the pair's base port, its engine settings)
BACKENDS = {"mooncake": ("mooncake.engine", 31000, {}),
            "nixl": ("nixl._api", 35000, {"disaggregation_transfer_backend": "nixl"})}
SWAP_PLAN = ('[{"fault": "swapped_entries", "seed": 1, "rid_prefix": "swap-a", "min_candidates": 2, "step": 3, '
             '"label": "swap"}]')
SWAP_RIDS = ["swap-a0", "swap-a1", "swap-b2", "swap-b3"]  # the i-th on prompt i; swap-a* are the candidates


def pd_prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 1000) for _ in range(24 + 3 * i)] for i in range(n)]


def fault_envs(mode: str, trigger: str, hold_s: float = HOLD_S, land: str | None = None) -> tuple[dict, dict]:
    """The prefill's and the decode's environment: kvguard's mode, and the faults each server carries (a send held
    at most ``hold_s`` seconds once ``trigger`` exists, prefill_index_shift on rids ``pshift-*``; swapped_entries on
    the decode server, its deferred-release timeout shortened to 1 s, and with ``land`` ("<late prefix>:<victim
    prefix>") the held write landing in a decoding victim's pages)."""
    prefill = {"KVGUARD_MODE": mode, "FAULTLAB_SGLANG_PD_SLOW_SEND": f"{trigger}:{hold_s}",
               "FAULTLAB_SGLANG_PD_PREFILL_SHIFT": "pshift-"}
    decode = {"KVGUARD_MODE": mode, "FAULTLAB_SGLANG_FAULTS": SWAP_PLAN,
              "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "1"}
    if land:
        decode["FAULTLAB_SGLANG_PD_LATE_LAND"] = f"{trigger}:{land}"
    return prefill, decode


def start_pair(backend: str, tmp_path_factory, mode: str, port_shift: int = 0, prefill_spec: dict | None = None,
               decode_spec: dict | None = None, **faults):
    """The pair on ``backend`` (skipped where its transfer engine does not import), both servers ``KVGUARD_MODE=mode``
    with the faults of :func:`fault_envs` (``faults``: its keywords): (pair, its folder, the held-send trigger file)."""
    from faultlab.sglang_live.pd_pair import Pair

    module, port, engine = BACKENDS[backend]
    pytest.importorskip(module, reason=f"{backend}'s transfer engine does not import here")
    folder = str(tmp_path_factory.mktemp(f"pd_{mode}_{backend}"))
    trigger = os.path.join(folder, "hold-next-send")
    pair = Pair(folder, *fault_envs(mode, trigger, **faults), base_port=port + port_shift, engine=engine,
                prefill_spec=prefill_spec, decode_spec=decode_spec)
    return pair, folder, trigger
