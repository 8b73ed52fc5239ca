"""Next-token choice: greedy, or temperature + top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be ≥ 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top-p must be in (0, 1]")
        self.generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.double() / self.temperature, dim=-1)
        if self.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_p, 0) - sorted_p >= self.top_p  # keep the smallest prefix reaching top_p
            sorted_p[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))
