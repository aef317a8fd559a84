"""Shared test workloads: seeded random prompts, some sharing a prefix (so the prefix cache is used)."""
import random

from faultlab.engine.requests import Request


def random_requests(n: int, seed: int, prefix_len: int = 32, shared: float = 0.5,
                    max_new: tuple[int, int] = (4, 20)) -> list[Request]:
    """``n`` requests over the tiny model's vocabulary; a fraction ``shared`` starts with one prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(prefix_len)]
    out = []
    for i in range(n):
        tokens = [rng.randrange(3, 256) for _ in range(rng.randint(4, 30))]
        out.append(Request(f"r{i}", (prefix + tokens) if rng.random() < shared else tokens, rng.randint(*max_new)))
    return out


def clean_outputs(engine, requests) -> dict:
    """Run ``requests`` to the end on ``engine``; assert no abort; {rid: output tokens} of the finished."""
    for r in requests:
        engine.add_request(r)
    events = engine.run()
    assert not [e for e in events if e.kind == "abort"]
    return {r.rid: r.output for r in engine.done}
