"""Requests as the scheduler sees them, and the events a client receives."""
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Request:
    """One generation request. The scheduler owns its state; clients read ``output`` and ``status``."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()
    temperature: float = 0.0
    seed: int = 0
    # -- scheduler state ----------------------------------------------------------------------------
    status: str = "waiting"  # waiting | running | finished | aborted
    row: int | None = None
    n_pages: int = 0  # logical pages mapped in the row
    n_shared: int = 0  # leading pages shared from the prefix cache (owned by the cache)
    nodes: list = field(default_factory=list)  # locked prefix-cache nodes
    output: list[int] = field(default_factory=list)
    error: str | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the cache (every token but the last sampled one)."""
        return len(self.prompt) + max(0, len(self.output) - 1)

    def pages_needed(self, page_size: int) -> int:
        """Pages a request may occupy by its end (admission reserves them all)."""
        return -(-(len(self.prompt) + self.max_new_tokens) // page_size)


@dataclass(frozen=True)
class Event:
    """What a client sees: a streamed token, a finish, or an abort with its error."""

    rid: str
    kind: str  # token | finish | abort
    step: int
    token: int | None = None
    message: str | None = None
