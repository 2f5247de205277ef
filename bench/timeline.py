"""When each token of each request appeared: the one record every system's run is reduced to.

pagedq (driven through its step API) and the Hugging Face baseline (timed from inside
``generate``) both fill a Timeline, so TTFT, inter-token latency and tokens/s are computed by
the same code for both sides of every comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTimes:
    """Arrival time and the wall time of each generated token (perf_counter seconds)."""

    arrival: float
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def itls(self) -> np.ndarray:
        return np.diff(np.asarray(self.token_times, dtype=float))


@dataclass
class Timeline:
    """Every request's token times over one run, between ``start`` and ``end``."""

    start: float
    end: float = 0.0
    requests: dict[str, RequestTimes] = field(default_factory=dict)

    def arrive(self, request_id: str, at: float) -> None:
        self.requests[request_id] = RequestTimes(arrival=at)

    def tokens(self, request_id: str, at: float, count: int) -> None:
        """Record ``count`` tokens that appeared together (one step) at time ``at``."""
        self.requests[request_id].token_times.extend([at] * count)

    @property
    def elapsed(self) -> float:
        return max(self.end - self.start, 1e-9)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.token_times) for r in self.requests.values())

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed

    def ttfts(self, ids: list[str] | None = None) -> np.ndarray:
        chosen = self._chosen(ids)
        return np.array([r.ttft for r in chosen if r.ttft is not None], dtype=float)

    def itls(self, ids: list[str] | None = None) -> np.ndarray:
        parts = [r.itls() for r in self._chosen(ids)]
        return np.concatenate(parts) if parts else np.zeros(0)

    def _chosen(self, ids: list[str] | None) -> list[RequestTimes]:
        if ids is None:
            return list(self.requests.values())
        return [self.requests[i] for i in ids]


def summarize(values: np.ndarray) -> dict[str, float | None]:
    """Mean and the usual percentiles; None for an empty sample rather than a made-up zero."""
    if values.size == 0:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "count": 0}
    out: dict[str, float | None] = {"mean": float(values.mean())}
    out.update({f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES})
    out["count"] = int(values.size)
    return out


def p99_over_p50(values: np.ndarray) -> float | None:
    """Tail-to-median ratio of a latency sample; None when it cannot be formed."""
    if values.size < 2:
        return None
    p50 = float(np.percentile(values, 50))
    return float(np.percentile(values, 99)) / p50 if p50 > 0 else None
