"""faultlab.sglang_live without a server: the fault plan, the plugin's off state, the CPU rotary op."""
import math

import pytest
import torch

from faultlab.sglang_live import cpu_rotary, inject, plan
from faultlab.sglang_live.runtime import State


def test_plan_parses_both_forms():
    assert [(e.fault, e.seed) for e in plan.parse_plan("swapped_entries, stale_row", seed=5)] == [
        ("swapped_entries", 5), ("stale_row", 5)]
    [entry] = plan.parse_plan('[{"fault": "in_page_entry", "seed": 3, "rid_prefix": "x-", "label": "l"}]')
    assert (entry.fault, entry.seed, entry.rid_prefix, entry.label) == ("in_page_entry", 3, "x-", "l")
    assert 2 <= entry.step <= 6
    assert plan.parse_plan("") == []


def test_plan_is_a_pure_function_of_the_seed():
    a, b, c = (plan.parse_plan('[{"fault": "index_shift", "seed": %d}]' % s)[0] for s in (7, 7, 8))
    draws = [(e.step, e.rng.random()) for e in (a, b, c)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


@pytest.mark.parametrize("text, named", [
    ("swaped_entries", "swaped_entries"),
    ('[{"fault": "stale_row", "when": 3}]', "allowed keys"),
    ('[{"seed": 3}]', "needs 'fault'"),
    ('[{"fault": "stale_row", "step": -1}]', "step"),
    ('[{"fault": "stale_row", "tp_rank": "1"}]', "tp_rank"),
    ('{"fault": "stale_row"}', "is not one of"),
    ("[not json", "not valid JSON"),
])
def test_bad_plan_stops_the_process_with_the_field_named(text, named):
    with pytest.raises(SystemExit) as info:
        inject.register({plan.ENV_FAULTS: text})
    assert plan.ENV_FAULTS in str(info.value) and named in str(info.value)


def test_bad_seed_is_named():
    with pytest.raises(SystemExit, match=plan.ENV_SEED):
        inject.register({plan.ENV_FAULTS: "stale_row", plan.ENV_SEED: "x"})


def test_registers_nothing_without_its_variables():
    assert inject.register({}) is False
    assert State.registered is False and State.plan == []


def _reference(positions, x, head_size, cache, neox):
    """The rotation as a complex product, written independently of the op under test."""
    t, rot = positions.numel(), cache.shape[1]
    view = x.view(t, -1, head_size).double()
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    turn = torch.complex(cos, sin)[:, None, :]
    part = view[..., :rot]
    if neox:
        z = torch.complex(part[..., : rot // 2], part[..., rot // 2:]) * turn
        out = torch.cat((z.real, z.imag), dim=-1)
    else:
        z = torch.complex(part[..., 0::2], part[..., 1::2]) * turn
        out = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((out, view[..., rot:]), dim=-1).view(t, -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot", [16, 8])
def test_cpu_rotary_matches_reference(neox, rot):
    gen = torch.Generator().manual_seed(rot + neox)
    t, heads, kv_heads, head_size, max_pos = 7, 4, 2, 16, 64
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q = torch.randn(t, heads * head_size, generator=gen)
    k = torch.randn(t, kv_heads * head_size, generator=gen)
    q_ref, k_ref = _reference(positions, q, head_size, cache, neox), _reference(positions, k, head_size, cache, neox)
    cpu_rotary.rotary_embedding(positions, q, k, head_size, cache, neox)  # in place
    for out, ref in ((q, q_ref), (k, k_ref)):
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 1e-6, err
    assert not math.isclose(float(q_ref.norm()), 0.0)


def _ep(fault, victims, outs, errors=(), balanced=True):
    return {"fault": fault, "victims": victims, "idle_check": {"balanced": balanced, "messages": []},
            "requests": [{"rid": f"x-a{i}", "output_ids": o, "error": "kvguard: ..." if f"x-a{i}" in errors else None}
                         for i, o in enumerate(outs)]}


def test_sweep_judge_names_each_way_an_episode_can_be_wrong():
    from faultlab.sglang_live.sweep import judge

    clean = _ep(None, [], [[1, 2], [3, 4]])
    assert judge(_ep("index_shift", ["x-a0"], [None, [3, 4]], errors=["x-a0"]), clean) == []
    assert "errors" in judge(_ep("index_shift", ["x-a0"], [[1, 2], [3, 4]]), clean)[0]
    assert "non-victims' tokens differ: ['x-a1']" in judge(
        _ep("index_shift", ["x-a0"], [None, [3, 5]], errors=["x-a0"]), clean)
    assert judge(_ep("index_shift", ["x-a0"], [None, [3, 4]], errors=["x-a0"], balanced=False), clean)[0].startswith(
        "accounting")
    assert judge(_ep("stale_row", [], [[1, 2], [3, 4]]), clean) == ["the injector reports no victim"]


def test_spec_run_passes_only_a_run_with_no_false_abort_and_every_fault_exact():
    from faultlab.sglang_live.spec_run import passed, summary

    def run(*eps):
        return {"episodes": [{**e, "label": f"e{i}", "seconds": 1.0, "idle_check": {**e["idle_check"], "decode_steps": 9}}
                             for i, e in enumerate(eps)],
                "startup_s": 1.0}

    clean = _ep(None, [], [[1, 2], [3, 4]])
    exact = _ep("spec_region_entry", ["x-a0"], [None, [3, 4]], errors=["x-a0"])
    assert passed(summary(run(clean, exact)))
    assert not passed(summary(run(clean, _ep("spec_region_entry", ["x-a0"], [None, [3, 5]], errors=["x-a0"]))))
    assert not passed(summary(run(_ep(None, [], [[1, 2], [3, 4]], errors=["x-a1"]))))  # a false abort
    assert not passed(summary(run()))  # a run that ran nothing


def test_sweep_judge_lets_a_retracted_victim_go_unaborted_only_with_fault_free_tokens():
    """SGLang recomputes a retracted request's KV from its tokens: a victim it retracted after the fault may finish
    without an error, with the fault-free tokens; a victim nobody retracted and nobody aborted is a miss."""
    from faultlab.sglang_live.sweep import judge

    clean = _ep(None, [], [[1, 2], [3, 4]])
    retracted = {"events": [{"event": "retract", "rid": "x-a0"}]}
    assert judge({**_ep("index_shift", ["x-a0"], [[1, 2], [3, 4]]), **retracted}, clean) == []
    assert "tokens differ: ['x-a0']" in judge({**_ep("index_shift", ["x-a0"], [[1, 9], [3, 4]]), **retracted},
                                              clean)[0]
    assert "errors" in judge({**_ep("index_shift", ["x-a1"], [[1, 2], [3, 4]]), **retracted}, clean)[0]
    assert judge({**_ep("index_shift", ["x-a0"], [None, [3, 4]], errors=["x-a0"]), **retracted}, clean) == []


@pytest.mark.parametrize("argv, named", [
    (["--seeds", "x"], "--seeds"), (["--seeds", "5-2"], "--seeds"), (["--out", "/nonexistent-dir/x.json"], "--out"),
])
def test_sweep_bad_input_exits_2_naming_the_option(argv, named, tmp_path, capsys):
    from faultlab.sglang_live import sweep

    argv = argv if "--out" in argv else argv + ["--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as info:
        sys_exit = sweep.main(argv)
        raise SystemExit(sys_exit)
    assert info.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_sweep_summary_counts_each_way_an_episode_went_wrong():
    from faultlab.sglang_live.sweep import summarize

    configs = {"a": {"deaths": ["x2"], "verdicts": {
        "clean": [], "x1": [], "x2": ["the server died in this episode"],
        "x3": ["errors [] != victims ['r-a0']", "non-victims' tokens differ: ['r-b1']"],
        "x4": ["non-victims' tokens differ: ['r-b0']"]}},
        "b": {"deaths": [], "verdicts": {"clean": [], "y1": []}}}
    assert summarize(configs) == {"fault_episodes": 5, "exact": 2, "server_deaths": 1,
                                  "episodes_victims_not_aborted": 1, "episodes_with_non_victim_token_mismatch": 2}
