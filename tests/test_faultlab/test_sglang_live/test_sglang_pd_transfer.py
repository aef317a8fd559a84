"""PD disaggregation over SGLang's real transfer backends, Mooncake and NIXL (host memory), on the CPU.

kvguard's path registry (kvguard/sglang/paths.py) names this file as the evidence for ``pd_decode_mooncake``,
``pd_prefill_mooncake``, ``pd_decode_nixl`` and ``pd_prefill_nixl``. Per backend, one prefill and one decode
``sglang.Engine``, each in a process of its own (faultlab/sglang_live/pd_pair.py), every request sent to both with
one bootstrap room, as SGLang's router does (a request the prefill server fails is then aborted on the decode
server); SGLang's bootstrap server runs in the prefill server. The KV moves through Mooncake's ``TransferEngine``
(``mooncake-transfer-engine-non-cuda``, ``MOONCAKE_PROTOCOL=tcp``) or NIXL's UCX backend (``nixl`` 1.5.1; on a CPU
device faultlab's shim labels SGLang's host KV buffers ``DRAM``, where SGLang would say ``VRAM`` and UCX would refuse
them: faultlab/sglang_live/cpu_pd.py). Both servers run ``KVGUARD_MODE=check``. The decode server's deferred-release
timeout is 1 s (SGLang's default: 30 s), so without kvguard an aborted transfer's destination would go back to the
allocator while its held write (faultlab/sglang_live/pd_faults.py) is still on its way.

What both backends' workers share, and kvguard.sglang.pd relies on: the decode side learns ``KVPoll.Success`` only
from the prefill's status message, sent (``CommonKVManager.conclude_transfer``) after every write of the room
returned (Mooncake) or read DONE (NIXL: its UCX backend reports DONE once its endpoint flush completed), and only for
a room not failed; an aborted room's ack is sent once its transfer worker drained it.

Episodes, in order: fault-free; ``prefill_index_shift`` on the prefill server; ``swapped_entries`` on the decode
server (the injector's victims are ground truth); a transfer aborted on the decode server while the prefill holds
its send (the write lands after the abort) with three requests sent just before it (on an idle machine they finish
within ~0.7 s, before the abort: what this episode always shows is the destination held until the drain ack,
SGLang's timeout release never running, and the pools balanced after the landing); fault-free again. On a pair of
its own per backend (the prefill without a radix cache): ``prefill_freed_mid_send``, a page of a request whose send
is in flight freed and taken by the next prefill before the send reads it
(faultlab.sglang_live.pd_sweep.run_prefill_free). A backend is skipped only where it cannot import (Mooncake: its
wheel, or Debian's libibverbs1 librdmacm1 libnuma1, missing).
The same pair and faults with kvguard off, what a client gets then: test_sglang_pd_transfer_off.py.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from faultlab.sglang_live.pd_sweep import (BACKENDS, HOLD_S, NEW, SWAP_RIDS, close_pair, fault_envs, judge_prefill_free,
                                          pd_prompts, run_prefill_free, send_held)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1500)]

LONG = 120  # the requests sent before the held one (and each soak round's)
# The soak (>= 1,000 fault-free decode steps per backend, after the episodes) runs from the command line:
# FAULTLAB_PD_TRANSFER_SOAK=9 pytest tests/test_faultlab/test_sglang_live/test_sglang_pd_transfer.py -k soak -s
SOAKS = int(os.environ.get("FAULTLAB_PD_TRANSFER_SOAK", "0"))  # rounds of 4 requests x LONG tokens (~120 steps each)


@pytest.fixture(scope="module", params=list(BACKENDS))
def pd(request, tmp_path_factory):
    from faultlab.sglang_live.pd_pair import Pair

    module, port, engine = BACKENDS[request.param]
    pytest.importorskip(module, reason=f"{request.param}'s transfer engine does not import here")
    folder = str(tmp_path_factory.mktemp(f"pd_check_{request.param}"))
    trigger = os.path.join(folder, "hold-next-send")
    pair = Pair(folder, *fault_envs("check", trigger), base_port=port, engine=engine)
    prompts = pd_prompts(5)  # the last one is the prefill fault's own (a prompt seen before is a radix hit there)
    out = {}
    try:
        out["clean"] = pair.generate([(f"clean-{i}", p, NEW) for i, p in enumerate(prompts[:4])])
        out["pshift"] = pair.generate([("pshift-4", prompts[4], NEW)] +
                                      [(f"pb-{i}", p, NEW) for i, p in enumerate(prompts[1:4], 1)])
        out["swap"] = pair.generate([(rid, p, NEW) for rid, p in zip(SWAP_RIDS, prompts)])
        time.sleep(1.0)
        out["swap_idle"] = pair.idle_checks(time.time())
        # a transfer aborted mid-flight: requests decode; the prefill holds the next send HOLD_S seconds; the decode
        # server aborts that request while its write is on its way (same transfer shard: it lands before any later
        # transfer, so only pages the running requests grow into can take it)
        for i, p in enumerate(prompts[1:4], 1):
            pair.send((f"run-{i}", p, LONG))
        time.sleep(2.0)  # they decode by now
        t = time.time()
        send_held(pair, trigger, ("late-0", prompts[0], NEW))  # the prefill's worker took it: the send is held
        held = time.time()
        time.sleep(0.5)
        pair.decode.send({"op": "abort", "rid": "late-0"})
        out["late"] = pair.answers(["late-0"])
        out["run"] = pair.answers([f"run-{i}" for i in (1, 2, 3)])
        out["late_s"] = time.time() - t
        time.sleep(max(0.0, HOLD_S + 2.0 - (time.time() - held)))  # the held send landed (and was acked)
        out["clean2"] = pair.generate([(f"clean2-{i}", p, LONG) for i, p in enumerate(prompts[:4])])
        time.sleep(1.0)
        out["idle"] = pair.idle_checks(time.time())
        for k in range(SOAKS):  # the command line's fault-free rounds (FAULTLAB_PD_TRANSFER_SOAK)
            out[f"soak{k}"] = pair.generate([(f"soak{k}-{i}", p, LONG) for i, p in enumerate(prompts[:4])])
        if SOAKS:
            time.sleep(1.0)
            out["soak_idle"] = pair.idle_checks(time.time())
    finally:
        close_pair(pair, out)
        with open(os.path.join(folder, "out.json"), "w") as f:
            json.dump(out, f)
    with open(os.path.join(folder, "decode.stderr")) as f:
        out["decode_stderr"] = f.read()
    return out


def test_pd_clean_requests_are_served(pd):
    clean = pd["clean"]
    assert all(r["error"] is None and len(r["output_ids"]) == NEW for r in clean.values()), clean
    for i in range(4):
        assert pd["clean2"][f"clean2-{i}"]["output_ids"][:NEW] == clean[f"clean-{i}"]["output_ids"]


def test_pd_prefill_fault_aborts_exactly_its_victim(pd):
    inject = [e for e in pd["prefill_events"] if e["event"] == "inject" and e.get("fault") == "prefill_index_shift"]
    assert [e["victims"] for e in inject] == [["pshift-4"]], inject
    victim = pd["pshift"]["pshift-4"]  # the prefill aborted it (kvguard), the router then aborted it on the decode
    assert victim["error"] is not None and victim["output_ids"] is None, victim
    assert "kvguard" in pd["prefill_answers"]["pshift-4"]["error"], pd["prefill_answers"]["pshift-4"]
    for i in (1, 2, 3):
        got = pd["pshift"][f"pb-{i}"]
        assert got["error"] is None and got["output_ids"] == pd["clean"][f"clean-{i}"]["output_ids"], (i, got)


def test_pd_decode_fault_aborts_exactly_its_victims(pd):
    inject = [e for e in pd["decode_events"] if e["event"] == "inject" and e.get("label") == "swap"]
    assert inject, "the injector did not strike on the decode server"
    victims = set(inject[0]["victims"])
    assert victims, inject
    for i, rid in enumerate(SWAP_RIDS):
        r = pd["swap"][rid]
        if rid in victims:
            assert r["error"] and "kvguard" in r["error"], (rid, r)
        else:
            assert r["error"] is None and r["output_ids"] == pd["clean"][f"clean-{i}"]["output_ids"], (rid, r)
    assert all(c is not None and c["balanced"] for c in pd["swap_idle"].values()), pd["swap_idle"]


def test_pd_aborted_transfer_lands_late_in_no_one_elses_pages(pd):
    late = pd["late"]["late-0"]
    assert late["error"] is not None, late
    for i in (1, 2, 3):  # decoding while the aborted transfer was on its way: untouched by its late write
        got = pd["run"][f"run-{i}"]
        assert got["error"] is None, got
        assert got["output_ids"] == pd["clean2"][f"clean2-{i}"]["output_ids"], (i, got)
    held = [ln for ln in pd["decode_stderr"].splitlines() if "kvguard: request late-0's transfer" in ln]
    assert held and "held until" in held[0], "kvguard did not hold the aborted transfer's destination"
    assert "Deferred KV release" not in pd["decode_stderr"], "SGLang released a destination on its timeout"
    assert all(c is not None and c["balanced"] for c in pd["idle"].values()), pd["idle"]


@pytest.mark.skipif(not SOAKS, reason="the command-line run only (FAULTLAB_PD_TRANSFER_SOAK)")
def test_pd_soak_serves_every_clean_request_unchanged(pd):
    steps = pd["idle"]["decode"]["decode_steps"]  # the decode server's decode batches before the soak
    for k in range(SOAKS):
        for i in range(4):
            got = pd[f"soak{k}"][f"soak{k}-{i}"]
            assert got["error"] is None and got["output_ids"] == pd["clean2"][f"clean2-{i}"]["output_ids"], (k, i, got)
    after = pd["soak_idle"]
    assert all(c is not None and c["balanced"] for c in after.values()), after
    print(f"soak: {after['decode']['decode_steps'] - steps} fault-free decode steps after the episodes "
          f"({after['decode']['decode_steps']} in all), 0 false aborts")
    assert after["decode"]["decode_steps"] - steps >= 1000


@pytest.fixture(scope="module", params=list(BACKENDS))
def pfree(request, tmp_path_factory):
    """``prefill_freed_mid_send`` (faultlab/sglang_live/pd_faults.py) on a pair of its own, kvguard on."""
    module, port, _ = BACKENDS[request.param]
    pytest.importorskip(module, reason=f"{request.param}'s transfer engine does not import here")
    folder = str(tmp_path_factory.mktemp(f"pfree_check_{request.param}"))
    out = run_prefill_free(request.param, "check", folder, port=port + 3000)
    with open(os.path.join(folder, "prefill.stderr")) as f:
        out["prefill_stderr"] = f.read()
    return out


def test_pd_prefill_page_freed_mid_send_fails_its_transfer(pfree):
    """A page of a request whose send is in flight is freed and taken by the next prefill, which writes its own K/V
    there before the send reads it: the room concludes Failed, so the victim's client gets an error (no token from
    the reuser's K/V), the reuser gets its fault-free tokens, and both servers' accounting is balanced."""
    assert judge_prefill_free(pfree) == [], judge_prefill_free(pfree)
    assert "pfree-v aborted: KV page" in pfree["prefill_stderr"] and "changed hands while its transfer" in \
        pfree["prefill_stderr"], "kvguard's conclusion check did not fail the room"
    assert pfree["prefill_answers"]["pfree-v"]["error"] is not None, pfree["prefill_answers"]["pfree-v"]
