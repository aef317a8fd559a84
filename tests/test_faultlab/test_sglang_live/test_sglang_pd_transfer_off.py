"""With kvguard off, the faults test_sglang_pd_transfer.py shows caught reach the clients, on the same real backends.

A comparison, not a kvguard expectation. kvguard's path registry (kvguard/sglang/paths.py) names
test_sglang_pd_transfer.py as the evidence that ``pd_decode_mooncake``, ``pd_prefill_mooncake``, ``pd_decode_nixl``
and ``pd_prefill_nixl`` are checked; a fault caught there proves something only if, left alone, it harms a client.
This file shows that it does: per backend, one prefill and one decode ``sglang.Engine``
(faultlab/sglang_live/pd_pair.py) as there, both ``KVGUARD_MODE=off``, the same fault settings: one pair of the PD
sweep (faultlab/sglang_live/pd_sweep.py, :func:`run_pair`, its fixed prompts), whose episodes are run here.
It runs in a pytest-xdist worker of its own beside that file (``--dist loadfile``), on ports of its own. Shown:

- ``swapped_entries`` on the decode server: its victims (the injector's ``inject`` line, ground truth) get all their
  tokens and no error, other tokens than the fault-free run's of the same prompt (at least one victim: a position
  swapped late in a row may change no greedy token); the others get the fault-free ones.
- ``prefill_index_shift`` on the prefill server: its victim is served without an error, with other tokens than the
  fault-free run's of its prompt, and the prefill's radix cache keeps the shifted row, so a later fault-free request
  with that prompt gets the victim's wrong tokens too.
- A transfer aborted while its send is held: SGLang releases its destination on its deferred-release timeout (1 s)
  while the write is still on its way (with kvguard the destination is held until the prefill's drain ack), its
  allocator hands those slots to requests that are decoding, and the late write lands there: they are served
  without an error, each one's tokens the fault-free run's up to the landing, and some of them other ones after it.

What differs from the checked pair, all for the prefill fault's fault-free reference: that prompt's reference runs
first (a prompt the prefill has seen is a radix hit there, and the shift strikes only at an extended position); the
prefill's pool is pd_sweep's PREFILL_TOKENS, so that the reference, the least recently used entry, leaves its radix
cache before the fault's episode; and that episode is the last, since with kvguard off the victim's row (one slot
twice, its own slot lost) stays in the prefill's radix cache, and evicting it would free the doubled slot twice.
And, for the late write: the decode server's pool is pd_sweep's DECODE_TOKENS with SGLang's decode reservation cut
to RESERVED, so that the four victims of LONG new tokens need the aborted transfer's slots (SGLang admits a new
request only while each running one's remaining need still fits, so one victim alone would never run the free list
dry).
(SGLANG_RADIX_FORCE_MISS does not help: a reference run after the fault is recomputed, but SGLang points its row at
the cached, shifted slots before its send, and its client gets the victim's tokens.)

How the late write is ordered, not timed: the prefill's transfer worker sends one decode server's transfers in
order, so a request preallocated after the abort is written after the late write; only a request decoding across
the hold can take the freed pages, and SGLang's PD allocator (``need_sort``) merges freed slots into its free list
only when that runs dry. So the victims start decoding first; the late request's send is held until the decode
server's injector (``FAULTLAB_SGLANG_PD_LATE_LAND``, faultlab/sglang_live/pd_faults.py) sees its destination freed,
merged and some of its slots given to victims and written by their forward; the decode server then waits for the
write to land before its next step. Until the release, the victims' steps are paced, so they do not run dry first.
"""
from __future__ import annotations

import json
import os

import pytest

from faultlab.sglang_live.pd_sweep import (BACKENDS, LAND_RIDS, LONG, NEW, SWAP_RIDS, judge, judge_prefill_free,
                                          run_pair, run_prefill_free, served_wrong)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

PORT_SHIFT = 10000  # the checked module's pair may run at the same time


@pytest.fixture(scope="module", params=list(BACKENDS))
def pd_off(request, tmp_path_factory):
    module, port, _ = BACKENDS[request.param]
    pytest.importorskip(module, reason=f"{request.param}'s transfer engine does not import here")
    folder = str(tmp_path_factory.mktemp(f"pd_off_{request.param}"))
    out = run_pair(request.param, "off", folder, port=port + PORT_SHIFT)
    with open(os.path.join(folder, "out.json"), "w") as f:
        json.dump(out, f)
    return out


def _clean(pd_off: dict, i: int) -> list[int]:
    return pd_off["clean"][f"clean-{i}"]["output_ids"]


def test_pd_clean_requests_are_served_with_kvguard_off(pd_off):
    clean = pd_off["clean"]
    assert all(r["error"] is None and len(r["output_ids"]) == NEW for r in clean.values()), clean


def test_pd_decode_fault_returns_wrong_tokens_with_kvguard_off(pd_off):
    inject = [e for e in pd_off["decode_events"] if e["event"] == "inject" and e.get("label") == "swap"]
    assert inject, "the injector did not strike on the decode server"
    victims = set(inject[0]["victims"])
    assert victims, inject
    changed = {}  # rid: how many of its tokens differ from the fault-free run's
    for i, rid in enumerate(SWAP_RIDS):
        got = pd_off["swap"][rid]
        assert got["error"] is None and len(got["output_ids"]) == NEW, f"with kvguard off {rid} is served: {got}"
        changed[rid] = sum(a != b for a, b in zip(got["output_ids"], _clean(pd_off, i)))
    print(f"kvguard off, swapped_entries at entries {inject[0]['entries']}: victims {sorted(victims)}, "
          f"tokens differing from the fault-free run {changed}")
    assert {rid for rid, n in changed.items() if n} - victims == set(), f"a non-victim's tokens changed: {changed}"
    # NOTE: each victim's mapping is broken (the injector's ground truth), but one swapped position late in a row need
    # not change a greedy token of this tiny model (seen: entry 27, swap-a0's tokens unchanged, swap-a1's last two)
    assert any(changed[rid] for rid in victims), f"no victim's tokens changed (is the fault real?): {changed}"


def test_pd_prefill_fault_returns_wrong_tokens_with_kvguard_off(pd_off):
    inject = [e for e in pd_off["prefill_events"] if e["event"] == "inject" and e.get("fault") == "prefill_index_shift"]
    assert [e["victims"] for e in inject] == [["pshift-4"]], inject
    assert pd_off["prefill_answers"]["pshift-4"]["error"] is None, pd_off["prefill_answers"]["pshift-4"]
    victim = pd_off["pshift"]["pshift-4"]
    assert victim["error"] is None and len(victim["output_ids"]) == NEW, f"with kvguard off it is served: {victim}"
    assert victim["output_ids"] != _clean(pd_off, 4), "the victim got the fault-free tokens"
    for i in (1, 2, 3):
        got = pd_off["pshift"][f"pb-{i}"]
        assert got["error"] is None and got["output_ids"] == _clean(pd_off, i), (i, got)
    # the prefill's radix cache kept the victim's row: a fault-free request with its prompt gets its wrong tokens
    after = pd_off["after"]["after-4"]
    assert after["error"] is None and after["output_ids"] == victim["output_ids"], (after, victim)


def test_pd_aborted_transfer_destination_released_while_its_write_is_in_flight(pd_off):
    late = pd_off["late"]
    assert late["answer"]["error"] is not None, late
    assert late["released"], f"SGLang did not release late-0's destination on its deferred-release timeout: {late}"


def test_pd_late_write_lands_in_decoding_requests_and_changes_their_tokens_with_kvguard_off(pd_off):
    late = pd_off["late"]
    dest = [e for e in pd_off["decode_events"] if e["event"] == "late_destination"]
    assert [e["rid"] for e in dest] == ["late-0"], dest
    inject = [e for e in pd_off["decode_events"] if e["event"] == "inject" and e["fault"] == "late_transfer_landed"]
    assert inject, "late-0's freed slots never reached the decoding victims (no inject line)"
    inject = inject[0]
    assert inject["landed"] and inject["victims"] and set(inject["victims"]) <= set(LAND_RIDS), inject
    assert all(set(slots) <= set(dest[0]["slots"]) for slots in inject["slots"].values()), (inject, dest)
    changed = {}  # victim: how many of its tokens after the landing differ from the fault-free run's
    for rid in LAND_RIDS:
        got, clean = late["victims"][rid], pd_off["clean_long"][f"clean-{rid}"]
        assert clean["error"] is None and len(clean["output_ids"]) == LONG, clean
        assert got["error"] is None and len(got["output_ids"]) == LONG, f"with kvguard off {rid} is served: {got}"
        m = inject["output_len_at_landing"].get(rid, LONG)  # a request that took none of the slots: all its tokens
        assert got["output_ids"][:m] == clean["output_ids"][:m], f"{rid}'s tokens before the landing differ"
        changed[rid] = sum(a != b for a, b in zip(got["output_ids"][m:], clean["output_ids"][m:]))
    print(f"kvguard off, late-0's write landed in {inject['slots']} at output lengths "
          f"{inject['output_len_at_landing']}: tokens after it differing from the fault-free run {changed}")
    assert any(changed.values()), f"the late write changed no victim's later tokens (is the fault real?): {changed}"


def test_the_pd_sweeps_judge_finds_every_fault_with_kvguard_off(pd_off):
    """The PD sweep's verdicts on this pair (kvguard off): no fault episode is exact, and the clients that got wrong
    tokens without an error include the prefill fault's victim and the fault-free request after it."""
    verdicts = judge(pd_off)
    assert verdicts["clean"] == [], verdicts
    assert any(p.startswith("errors [] != victims") for p in verdicts["swapped_entries"]), verdicts
    assert any("released late-0's destination on its timeout" in p for p in verdicts["late_transfer_landed"]), verdicts
    assert any(p.startswith("errors [] != victims ['pshift-4']") for p in verdicts["prefill_index_shift"]), verdicts
    assert any("after-4" in p for p in verdicts["after"]), verdicts
    wrong = served_wrong(pd_off)
    assert {"pshift-4", "after-4"} <= set(wrong), wrong
    assert set(wrong) & set(LAND_RIDS), wrong


@pytest.fixture(scope="module", params=list(BACKENDS))
def pfree_off(request, tmp_path_factory):
    module, port, _ = BACKENDS[request.param]
    pytest.importorskip(module, reason=f"{request.param}'s transfer engine does not import here")
    return run_prefill_free(request.param, "off", str(tmp_path_factory.mktemp(f"pfree_off_{request.param}")),
                            port=port + PORT_SHIFT + 3000)


def test_pd_prefill_page_freed_mid_send_serves_wrong_tokens_with_kvguard_off(pfree_off):
    """The same fault as the checked module's, kvguard off: the victim's send reads the reuser's K/V and the decode
    server serves the victim other tokens than the fault-free run's, without an error."""
    problems = judge_prefill_free(pfree_off)
    assert "errors [] != victims ['pfree-v'] (served wrong tokens)" in problems, problems
    victim = pfree_off["answers"]["pfree-v"]
    assert victim["error"] is None and len(victim["output_ids"]) == NEW, victim
