"""CPU decode speed of the real model (SmolLM2, INT4 weights, FP8 KV, page size 16), batch 1 and 16.

    python bench/cpu_decode_speed.py --out bench/results/cpu_decode_speed.json

Decode tokens/s = generated tokens / time spent in decode steps (prefill excluded), batched decoding
(batch_invariant=False), torch.set_num_threads(2). Reference: transformers' GGUF path on the same
2 cores, ~22 tok/s at batch 1 and ~200 tok/s at batch 16 (shared/reference/notes.md).
"""
import argparse
import json
import time

import torch

from faultlab.engine.engine import Engine, EngineConfig
from faultlab.engine.requests import Request


def measure(batch: int, new_tokens: int, kv: str, weights: str) -> dict:
    engine = Engine(EngineConfig(model="smollm2", kv_dtype=kv, weight_dtype=weights, page_size=16,
                                 kv_budget_mb=256, max_running=batch, batch_invariant=False))
    prompt = engine.tokenizer.encode("The history of the printing press begins")
    for i in range(batch):
        engine.add_request(Request(f"r{i}", prompt + [i + 10], new_tokens))
    engine.step()  # prefill (+ first token)
    steps, tokens, start = 0, 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(e.kind == "token" for e in engine.step())
        steps += 1
    seconds = time.perf_counter() - start
    return {"batch": batch, "kv_dtype": kv, "weights": weights, "decode_steps": steps, "tokens": tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/cpu_decode_speed.json")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = [measure(b, args.tokens, "fp8", "int4") for b in (1, 16)]
    for r in rows:
        print(r)
    with open(args.out, "w") as f:
        json.dump({"command": "python bench/cpu_decode_speed.py", "threads": 2, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
