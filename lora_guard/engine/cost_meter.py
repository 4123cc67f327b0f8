"""What the engine's own steps say a page costs to bring back.

Two lines fitted as the engine runs, by least squares with old samples fading (each new one
weighs as much as the last ``1 / (1 - DECAY)`` together): a step's milliseconds on its
prefilled tokens (so a prompt token's cost is the slope), an adapter's write into the pool on
its pages, and its read from disk on its pages. Until a line has seen both
ends of its range, the prior (the demo model's costs on a CPU, ``simulate_costs.Costs``) stands
in. A GPU deployment and a CPU one thus value a cached block against an adapter each by its own
costs. A replay on a modelled clock (``bench.virtual_time``) feeds the modelled costs instead
(``external``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.99
PRIOR_PREFILL_MS = 1.59  # per prompt token
PRIOR_WRITE_MS = (10.6, 0.05)  # fixed, per page
PRIOR_READ_MS = (5.0, 0.6)


@dataclass
class Line:
    """``y = a + b * x`` fitted online with fading weights; ``prior`` until ``x`` has varied."""

    prior: tuple[float, float]
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n, self.sx, self.sy = self.n * DECAY + 1, self.sx * DECAY + x, self.sy * DECAY + y
        self.sxx, self.sxy = self.sxx * DECAY + x * x, self.sxy * DECAY + x * y

    def coefficients(self) -> tuple[float, float]:
        spread = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or spread <= 1e-9 * max(self.n * self.sxx, 1.0):
            return self.prior
        slope = (self.n * self.sxy - self.sx * self.sy) / spread
        if slope < 0:
            return self.prior
        return (self.sy - slope * self.sx) / self.n, slope

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return max(a + b * x, 0.0)


@dataclass
class CostMeter:
    """The costs the pool's eviction choice reads (``restore_ms`` of each candidate)."""

    external: bool = False  # a replay feeds modelled costs; the engine feeds none of its own
    steps: Line = field(default_factory=lambda: Line((30.0, PRIOR_PREFILL_MS)))
    writes: Line = field(default_factory=lambda: Line(PRIOR_WRITE_MS))
    reads: Line = field(default_factory=lambda: Line(PRIOR_READ_MS))

    def step(self, prefill_tokens: int, ms: float) -> None:
        self.steps.add(prefill_tokens, ms)

    def write(self, pages: int, ms: float) -> None:
        self.writes.add(pages, ms)

    def read(self, pages: int, ms: float) -> None:
        self.reads.add(pages, ms)

    def prefill_ms(self, tokens: int) -> float:
        """Milliseconds ``tokens`` prompt tokens add to a step."""
        return self.steps.coefficients()[1] * tokens

    def adapter_ms(self, pages: int, in_host: bool) -> float:
        """Milliseconds to bring an adapter of ``pages`` pages back into the pool."""
        return self.writes(pages) + (0.0 if in_host else self.reads(pages))
