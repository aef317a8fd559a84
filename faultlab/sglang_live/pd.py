"""PD-disaggregated decode (SGLang 0.5.23, ``disaggregation_mode="decode"``, fake transfer backend): faultlab
plays the prefill side's KV writer, and strikes ``late_transfer_write``.

With the fake backend nothing is transferred: a request's prompt KV is whatever its destination pages held
before, so its output depends on page placement and no two episodes can be compared. The writer
(:func:`after_commit_transfer`, AFTER ``DecodeTransferQueue._commit_transfer_to_req``, where SGLang
commits a finished transfer to its request) therefore writes what a prefill server would have sent:

* K/V for the transferred positions ``[0, fill_len)``, every layer, at the request's slots
  ``req_to_token[row, 0:fill_len]``: values that are a pure function of (token id, position, layer)
  (:func:`kv_values`), through the pool's own ``set_kv_buffer``;
* the handoff token (the prefill's first sampled token): a pure function of the prompt (SGLang's fake
  backend hashes the rid instead, which differs between episodes);
* then, as a writer does after its KV landed, ``kvguard.sglang.plugin.stamp_transfer`` with the request's
  transfer ticket (None-safe: with ``KVGUARD_MODE=off`` there is no ticket).

Each transfer is kept in :attr:`runtime.State.transfers` (the writer's own view: row, slots and tokens
read from ``req_to_token`` at commit, the ticket), also after the request finished.

``late_transfer_write`` (:func:`strike_late_write`): a finished request A's transfer lands late. Its
pages were freed and handed to later requests by SGLang's normal allocation; faultlab writes A's K/V
into A's slots and stamps A's ticket. Victims: every request of the decode batch that now holds one of
A's pages (a request still waiting for its own transfer is not: that transfer overwrites the late write).

torch and SGLang are imported inside functions.
"""
from __future__ import annotations

import hashlib

from .plan import Entry
from .runtime import State, label_of, log

_SEED = 0x5EED  # the K/V tables' seed (any fixed value: the values only need to be the same every run)


def kv_values(tokens, positions, layer: int, head_num: int, head_dim: int, v_head_dim: int, vocab: int):
    """(k, v), each ``[N, heads, dim]`` float32: a pure function of (token id, position, layer).

    A seeded normal table per (layer, k|v) over the vocabulary, plus a position term, so that one token
    at two positions (or in two layers) gets different K/V, as a real prefill's would.
    """
    import torch

    tables = State.kv_tables
    key = (layer, head_num, head_dim, v_head_dim, vocab)
    if key not in tables:
        out = []
        for which, dim in enumerate((head_dim, v_head_dim)):
            gen = torch.Generator(device="cpu").manual_seed(_SEED + 2 * layer + which)
            out.append(torch.randn(vocab, head_num, dim, generator=gen))
        tables[key] = tuple(out)
    k_table, v_table = tables[key]
    tok = torch.as_tensor(tokens, dtype=torch.long)
    pos = torch.as_tensor(positions, dtype=torch.float32)[:, None, None]  # [N, 1, 1]

    def wave(dim):
        freq = torch.arange(1, dim + 1, dtype=torch.float32) / dim  # [dim]
        return 0.5 * torch.sin(pos * freq + layer)  # [N, 1, dim]

    return k_table[tok] + wave(head_dim), v_table[tok] + wave(v_head_dim)


def write_kv(pool, slots, tokens, positions, vocab: int) -> None:
    """Write the K/V of ``tokens`` at ``positions`` into ``slots`` of every layer of an MHA pool."""
    head_num, head_dim = getattr(pool, "head_num", None), getattr(pool, "head_dim", None)
    if head_num is None or head_dim is None or getattr(pool, "k_buffer", None) is None:
        raise NotImplementedError(f"faultlab's PD writer writes MHA pools only, not {type(pool).__name__}")
    v_head_dim = getattr(pool, "v_head_dim", None) or head_dim
    for i in range(len(pool.k_buffer)):
        layer = pool.start_layer + i
        k, v = kv_values(tokens, positions, layer, head_num, head_dim, v_head_dim, vocab)
        pool.set_kv_buffer(None, slots, k.to(slots.device), v.to(slots.device), layer_id_override=layer)


def handoff_token(tokens, vocab: int) -> int:
    """The prefill's first sampled token, as faultlab's writer sends it: a pure function of the prompt."""
    digest = hashlib.blake2b(",".join(map(str, tokens)).encode(), digest_size=8, person=b"faultlab").digest()
    return 3 + int.from_bytes(digest, "little") % (vocab - 3)  # never a special token (0, 1, 2)


def after_commit_transfer(result, queue, decode_req, *args, **kwargs):
    """AFTER ``DecodeTransferQueue._commit_transfer_to_req``: the transfer's KV lands, the writer stamps."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    req = decode_req.req
    if req.finished() or not _is_fake_transfer(req):  # aborted at commit; a real backend wrote its own KV
        return None
    scheduler = queue.scheduler
    allocator = scheduler.token_to_kv_pool_allocator
    row, fill = int(req.kv.req_pool_idx), int(req.kv.kv_committed_len)
    slots = scheduler.req_to_token_pool.req_to_token[row, :fill].clone()  # [fill] the transfer's destination
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[:fill]
    vocab = int(req.vocab_size)
    write_kv(allocator.get_kvcache(), slots, tokens, list(range(fill)), vocab)
    req.output_ids[-1] = handoff_token(list(req.origin_input_ids), vocab)
    ticket = _stamp(allocator, req)
    ps = int(allocator.page_size)
    pages = sorted({int(s) // ps for s in slots.tolist()})
    State.transfers[str(req.rid)] = {"row": row, "slots": slots, "tokens": tokens, "ticket": ticket,
                                     "pages": pages}
    log("transfer", label=label_of(str(req.rid)), rid=str(req.rid), row=row, fill_len=fill, pages=pages,
        ticket=ticket is not None)
    return None


def _stamp(allocator, req):
    """kvguard's writer stamp (the ticket it handed out at prealloc); None when kvguard is not loaded."""
    try:
        from kvguard.sglang.plugin import stamp_transfer, transfer_ticket
    except ImportError:
        return None
    ticket = transfer_ticket(req)
    stamp_transfer(allocator, ticket)
    return ticket


def strike_late_write(entry: Entry, batch) -> None:
    """A finished candidate's transfer lands late, in pages SGLang has handed to the requests now decoding."""
    allocator = batch.token_to_kv_pool_allocator
    table, ps = batch.req_to_token_pool.req_to_token, int(allocator.page_size)
    # NOTE: the decode batch's requests only: a request still in SGLang's transfer queue holds its pages
    # too, but its own transfer lands after this write (and its writer stamps its own ticket).
    held = {}  # page -> rids of the decoding requests that hold it now
    for req in batch.reqs:
        if req.finished() or req.kv.req_pool_idx is None:
            continue
        n = int(req.kv.kv_committed_len)
        for page in set((table[int(req.kv.req_pool_idx), :n].long() // ps).tolist()):
            held.setdefault(page, []).append(str(req.rid))
    done = sorted(str(r.rid) for r in entry.candidates if r.finished() and str(r.rid) in State.transfers)
    reused = [rid for rid in done if any(p in held for p in State.transfers[rid]["pages"])]
    if not reused:
        return log("skipped", fault=entry.fault, seed=entry.seed, label=entry.label,
                   reason=f"no finished candidate's pages are held now (finished: {done})")
    late = entry.rng.choice(reused)
    t = State.transfers[late]
    write_kv(allocator.get_kvcache(), t["slots"], t["tokens"], list(range(len(t["tokens"]))),
             int(batch.reqs[0].vocab_size))
    if t["ticket"] is not None:
        from kvguard.sglang.plugin import stamp_transfer

        stamp_transfer(allocator, t["ticket"])
    victims = sorted({rid for p in t["pages"] for rid in held.get(p, [])})
    log("inject", fault=entry.fault, seed=entry.seed, label=entry.label, step=entry.reuser_step,
        victims=victims, late=late, pages=t["pages"], reused=sorted(p for p in t["pages"] if p in held),
        page_size=ps, stamped=t["ticket"] is not None)
