"""Scenarios with a base: `base = "other.toml"` takes that scenario, this file's keys override it."""
import subprocess
import sys
from pathlib import Path

import pytest

from faultlab.chaos.scenario import ScenarioError, load

REPO = Path(__file__).resolve().parents[2]


def test_derived_scenario_overrides_key_by_key():
    base, derived = load(REPO / "scenarios/smoke.toml"), load(REPO / "scenarios/smoke_cuda_residual.toml")
    assert derived.name == "smoke_cuda_residual"
    assert (derived.engine.backend, derived.engine.device, derived.engine.cuda_graphs) == ("triton", "cuda", True)
    assert derived.engine.kv_residual and derived.engine.kv_residual_window == 32
    assert derived.faults.seeds == 3 and derived.faults.classes == base.faults.classes
    assert derived.workload == base.workload and derived.engine.num_pages == base.engine.num_pages


def test_base_cycle_and_bad_base_are_rejected(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\nname = "a"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\nname = "b"\n')
    with pytest.raises(ScenarioError, match="cycle"):
        load(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('base = "missing.toml"\nname = "c"\n')
    with pytest.raises(ScenarioError, match="missing.toml"):
        load(tmp_path / "c.toml")
    (tmp_path / "d.toml").write_text('base = 3\nname = "d"\n')
    with pytest.raises(ScenarioError, match="'base'"):
        load(tmp_path / "d.toml")


def test_an_override_is_validated_like_any_key(tmp_path):
    (tmp_path / "e.toml").write_text(f'base = "{REPO / "scenarios/smoke.toml"}"\nname = "e"\n[engine]\npage_size = 7\n')
    with pytest.raises(ScenarioError, match="page_size"):
        load(tmp_path / "e.toml")
    out = subprocess.run([sys.executable, "-m", "faultlab.chaos.cli", "run", str(tmp_path / "e.toml")], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 2 and "page_size" in out.stderr
