"""NIXL's UCX backend on the GPU machine, before SGLang uses it (after ``source bench/nixl_gpu_setup.sh``):
two agents, a VRAM -> VRAM WRITE of 64 MiB, the bytes compared. Prints the plugins found and the transfer's time."""
import time

import torch
from nixl._api import nixl_agent, nixl_agent_config

cfg = nixl_agent_config(backends=["UCX"])
a, b = nixl_agent("smoke-a", cfg), nixl_agent("smoke-b", cfg)
print("plugins:", a.get_plugin_list())
src = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8, device="cuda")
dst = torch.zeros_like(src)
a.register_memory(src)
b.register_memory(dst)
a.add_remote_agent(b.get_agent_metadata())
handle = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), "smoke-b", b"done")
t = time.perf_counter()
state = a.transfer(handle)
while state not in ("DONE", "ERR"):
    state = a.check_xfer_state(handle)
torch.cuda.synchronize()
dt = time.perf_counter() - t
print(f"state {state}; {64 / dt / 1024:.1f} GiB/s; bytes equal: {torch.equal(src, dst)}")
assert state == "DONE" and torch.equal(src, dst)
