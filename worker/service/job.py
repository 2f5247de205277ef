"""The worker's record of one job it currently owns, and the table of them all.

The table (engine id -> LiveJob) is the one piece of state every part of the worker shares:
admission adds to it, the outbox and the lease keeper take jobs out of it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedq.client.protocol import Request, engine_id


@dataclass
class LiveJob:
    """A claimed job: where it came from, its fencing epoch and how far its stream has got.

    ``generated[i]`` is sample i's published token count (its next event's start position);
    ``seq`` the number of events in its output stream, so a retried publish is idempotent.
    """

    request: Request
    stream: str  # the job stream it was read from
    entry_id: str
    fields: dict[bytes, bytes]  # the original entry, re-added as is on a hand-back
    epoch: int
    seq: int
    generated: list[int]
    finished: list[str | None]
    resumed_tokens: int = 0
    prompt_tokens: int = 0
    closing: bool = False  # a terminal event is queued, or the job is being given up
    admitted: float = field(default_factory=time.time)
    first_token: float | None = None
    last_token: float | None = None
    # monotonic time ownership and the cancel flag were last read from Redis: every successful
    # publish reads both, so the poller only asks about jobs that have not published lately
    checked: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def engine_id(self) -> str:
        """Engine-side id: a later owner epoch of the same request never sees stale outputs."""
        return engine_id(self.request.id, self.epoch)

    @property
    def n(self) -> int:
        return self.request.params.n

    @property
    def all_finished(self) -> bool:
        return all(r is not None for r in self.finished)

    @property
    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": sum(self.generated)}


Jobs = dict[str, LiveJob]  # engine id -> the job


def owned(jobs: Jobs) -> list[LiveJob]:
    """The jobs still running for their client: none of them is closing."""
    return [j for j in jobs.values() if not j.closing]
