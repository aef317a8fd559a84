"""Tensor parallelism for the Llama model and the engine, on torch.distributed (gloo on CPU, NCCL on CUDA).

Sharding (Megatron style, `world` ranks, rank `r`):
- column-parallel: wq, wk, wv split by heads, w_gate and w_up split by ffn columns (rows of W [N, K]);
  an INT4 matrix is split along N (rows of qweight/scales/mins: exact, no requantization);
- row-parallel: wo and w_down split along K (in whole quantization groups for INT4), each followed by
  one all-reduce (SUM) of its partial output;
- replicated: embedding, norms, output head (every rank computes the same full logits).

Rank r holds Q heads [r * Hq/world, ...) and KV heads [r * Hkv/world, ...), so GQA groups stay on one rank
and each rank keeps its KV shard in its own ``PagedKVCache`` (n_kv_heads / world heads). The shard's
``ModelConfig`` (heads and ffn divided by world) is the model's ``config``, so the engine sizes the
local pool from it unchanged.

Every rank runs the same deterministic scheduler (``TPEngine``): same requests, same allocator, same
page table; kvguard's ``RankTracker`` combines the per-request verdict across ranks so every rank
aborts the same requests, and ``TPEngine`` checks once per step that the schedulers still agree.

Verdict piggyback (``RankTracker(piggyback=True)``): a check's ride (a ``kvguard.distributed.VerdictRide``)
travels in the forward's ``StepContext`` (``ctx.ride``); the model hands it to the last layer's w_down,
whose row-parallel all-reduce (the forward's last) carries the rank's per-request flags as extra columns,
so the verdict needs no all-reduce of its own. ``TPEngine`` puts the ride of each check in the context of
the forward that follows it: the decode batch's (in batch-invariant mode, row by row, the last row's piece
carries all B flags as B columns of its one row) and the prefill's (its last token's piece; a prefill
checks one request, so one extra column). Prefill and decode both ride: with piggyback the engine issues
no verdict all-reduce at all.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist

from .config import get_preset
from .engine import ConfigError, Engine, EngineConfig
from .model import LlamaModel
from .shapes import ModelConfig
from .weights import Int4Weight, LayerWeights, Linear, ModelWeights, random_weights

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off in every process that imports us


class ScheduleDivergence(RuntimeError):
    """The ranks' schedulers disagree (different batches): continuing would mismatch collectives."""


# -- sharding --------------------------------------------------------------------------------------
def _split(n: int, world: int, unit: int, what: str) -> int:
    """n / world, checked to be a whole number of `unit`s."""
    if n % world or (n // world) % unit:
        raise ValueError(f"{what} = {n} does not split into {world} shards of whole {unit}s")
    return n // world


def shard_rows(w: Linear, rank: int, world: int) -> Linear:
    """Column-parallel shard: rows [r * N/world, (r+1) * N/world) of W [N, K] (INT4: qweight/scales/mins)."""
    n = w.shape[0]
    size = _split(n, world, 1, "rows")
    sl = slice(rank * size, (rank + 1) * size)
    if isinstance(w, Int4Weight):
        return Int4Weight(w.qweight[sl].contiguous(), w.scales[sl].contiguous(), w.mins[sl].contiguous(),
                          w.group_size)
    return w[sl].contiguous()


def shard_cols(w: Linear, rank: int, world: int) -> Linear:
    """Row-parallel shard: columns [r * K/world, ...) of W [N, K]; INT4 in whole groups of G."""
    k = w.shape[1]
    if isinstance(w, Int4Weight):
        size = _split(k, world, w.group_size, "in-features")
        q = slice(rank * size // 2, (rank + 1) * size // 2)
        g = slice(rank * size // w.group_size, (rank + 1) * size // w.group_size)
        return Int4Weight(w.qweight[:, q].contiguous(), w.scales[:, g].contiguous(), w.mins[:, g].contiguous(),
                          w.group_size)
    size = _split(k, world, 1, "in-features")
    return w[:, rank * size:(rank + 1) * size].contiguous()


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank computes: Q/KV heads and ffn divided by world (hidden, vocab unchanged)."""
    _split(config.n_kv_heads, world, 1, "n_kv_heads")
    _split(config.ffn, world, 1, "ffn")
    return replace(config, name=f"{config.name}/tp{world}", n_heads=config.n_heads // world,
                   n_kv_heads=config.n_kv_heads // world, ffn=config.ffn // world)


def shard_layer(lw: LayerWeights, rank: int, world: int) -> LayerWeights:
    """One block's weights on one rank."""
    col = lambda w: shard_rows(w, rank, world)  # noqa: E731
    row = lambda w: shard_cols(w, rank, world)  # noqa: E731
    return LayerWeights(attn_norm=lw.attn_norm, wq=col(lw.wq), wk=col(lw.wk), wv=col(lw.wv), wo=row(lw.wo),
                        ffn_norm=lw.ffn_norm, w_gate=col(lw.w_gate), w_up=col(lw.w_up), w_down=row(lw.w_down))


def shard_weights(config: ModelConfig, weights: ModelWeights, rank: int, world: int):
    """(shard config, shard weights) of rank `rank` out of `world`."""
    local = shard_config(config, world)
    layers = tuple(shard_layer(lw, rank, world) for lw in weights.layers)
    return local, ModelWeights(weights.embedding, layers, weights.final_norm, weights.output, weights.weight_dtype)


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowParallel:
    """A row-parallel linear's shard: its partial outputs are summed over the ranks (all-reduce)."""

    weight: Linear


class TPLlamaModel(LlamaModel):
    """``LlamaModel`` on one TP rank: shards the full weights at construction, all-reduces after wo and w_down.

    ``config`` is the shard's shape (see ``shard_config``); ``full_config`` the model's.
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, group=None, backend: str = "torch",
                 act_dtype: torch.dtype | None = None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.full_config = config
        local, shard = shard_weights(config, weights, self.rank, self.world)
        super().__init__(local, shard, backend=backend, act_dtype=act_dtype)

    def _prepare_layer(self, lw):
        layer = super()._prepare_layer(lw)
        return replace(layer, wo=RowParallel(layer.wo), w_down=RowParallel(layer.w_down))

    def linear(self, x: torch.Tensor, w, ride=None) -> torch.Tensor:
        """``LlamaModel.linear``; a ``RowParallel`` weight's output is summed over the ranks.

        ``ride`` (a ``VerdictRide``, given at the forward's last all-reduce): the verdict flags ride along.
        """
        if not isinstance(w, RowParallel):
            return super().linear(x, w, ride)
        y = super().linear(x, w.weight)
        if ride is not None:
            y = ride.board(y)
        if self.world > 1:
            dist.all_reduce(y, group=self.group)
        return y if ride is None else ride.land(y)


@lru_cache(maxsize=8)
def load_tp_model(name: str, weight_dtype: str, backend: str, device: str, seed: int, group=None) -> TPLlamaModel:
    """This rank's shard of the random-weight preset `name` (the same seeded weights as ``load_model``)."""
    if name == "smollm2":
        raise ValueError("TP runs random-weight presets only (the GGUF loader is single-process)")
    config = get_preset(name)
    weights = random_weights(config, seed=seed, weight_dtype=weight_dtype, device=device)
    return TPLlamaModel(config, weights, group=group, backend=backend)


# -- the engine ------------------------------------------------------------------------------------
def _fingerprint(engine: Engine) -> int:
    """A number every rank's scheduler state must agree on (rids running/waiting, free pages, step)."""
    text = ",".join([str(engine.step_id), str(engine.allocator.available()),
                     "|".join(r.rid for r in engine.running), "|".join(r.rid for r in engine.waiting)])
    return zlib.crc32(text.encode())  # not hash(): str hashes differ between processes


class TPEngine(Engine):
    """The engine on one TP rank: the same scheduler on every rank, the model and KV pool sharded.

    Pass a ``kvguard.distributed.RankTracker`` so the ranks abort the same requests. With
    ``verify_schedule`` every step starts with one all-reduce that raises ``ScheduleDivergence`` if
    the ranks' schedulers disagree (instead of mismatching collectives later).
    """

    def __init__(self, config: EngineConfig = EngineConfig(), tracker=None, observers=(), *, group=None,
                 verify_schedule: bool = True):
        if config.phase_split or config.memory != "native":
            raise ConfigError("TPEngine supports memory='native' without phase_split")
        self.group, self.verify_schedule = group, verify_schedule
        self.tp_rank, self.tp_world = dist.get_rank(group), dist.get_world_size(group)
        self.verdict_checks = 0  # checks launched (validate returned a check)
        self.verdict_rides = 0  # of those, checks whose verdict rode a forward's all-reduce (piggyback)
        super().__init__(config, tracker, observers)

    def _load_model(self):
        c = self.config
        return load_tp_model(c.model, c.weight_dtype, c.backend, c.device, c.seed, self.group), None

    # -- verdict piggyback: the check's ride goes into the context of the forward after it ----------
    def _step_ride(self, check, graphed: bool):
        """The check's ride for this step's context; a graph replay takes none: the verdict's own all-reduce."""
        self.verdict_checks += check is not None
        ride = getattr(check, "ride", None)
        if ride is None:
            return None
        if graphed:
            ride.combine()
            return None
        self.verdict_rides += 1
        return ride

    def step(self):
        """``Engine.step``, after checking that every rank schedules the same step."""
        if self.verify_schedule:
            self.check_schedule()
        return super().step()

    def check_schedule(self) -> None:
        """One all-reduce (MAX) of (fingerprint, -fingerprint): min != max means the ranks diverged."""
        fp = _fingerprint(self)
        both = torch.tensor([fp, -fp], dtype=torch.int64, device=self._collective_device())
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != -int(both[1]):
            raise ScheduleDivergence(f"rank {self.tp_rank}: schedulers diverged before step {self.step_id + 1}")

    def _collective_device(self) -> torch.device:
        """Where the scheduler check's tensor lives: the GPU for NCCL; the host for gloo (also on CUDA:
        the value is read on the host right after, and gloo would stage a CUDA tensor through it anyway)."""
        return torch.device(self.config.device) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
