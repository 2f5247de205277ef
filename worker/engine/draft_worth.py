"""How many looked-up draft tokens are worth their verification rows, by measuring both.

Why: a draft token costs a query row whether it is accepted or not, and what a row costs
against what a token is worth depends on the batch. At one stream a step reads all the weights
for one row, so an extra row costs ~0.12 of a token (Zen 5, 2 threads: 0.38 ms against 3.2);
at 8 streams the step is bound by the products and a row costs ~0.55 of one (0.55 ms against
0.96). The looked-up tokens (n-gram, suffix) are accepted ever less often the deeper they sit:
on the bench's extraction jobs at 8 streams the first was accepted 0.65 of the times it was
drafted, the third 0.38, the fourth 0.14 and the fifth and sixth almost never, so from the
third on they cost more rows than they made tokens. A token the grammar forces is accepted
0.76-1.0 of the time at every depth and is always drafted (drafts.py).

``DraftWorth`` keeps, per kind of sequence (with a grammar or without: their lookups differ),
each lookup depth's acceptance (the share of drafts with a token at that depth that had it
accepted, the forced tokens before it included), decayed so it follows the workload, and each
sequence keeps its own (``Sequence.draft_depths``): a worker serving edit and chat jobs at once
sees both kinds of unconstrained sequence, whose lookups are accepted ~0.9 and ~0.5 of the
time, so a sequence's estimate is its own counts with the kind's rate as a prior worth PRIOR
drafts. A draft keeps the lookup depths whose estimate exceeds the row cost the speculation
governor measured for the step's batch size (``SpecGovernor.draft_row_cost``); so an open chat
at 8 streams, whose lookups are rarely right, soon drafts nothing and runs plain steps. One
proposal in EXPLORE_EVERY gets a depth more, so a depth that was cut goes on being measured and
returns when the workload starts copying.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.995  # weight a verified draft's counts keep per later draft of the same kind
MIN_WEIGHT = 8.0  # a depth with fewer (decayed) drafts of its kind is not judged by them yet
PRIOR = 4.0  # drafts' worth of the kind's rate in a sequence's estimate
EXPLORE_EVERY = 16  # one proposal in this many may draft a depth past the worthwhile ones


@dataclass
class DepthCounts:
    """Counts of drafts that reached each lookup depth and of those accepted there, each
    multiplied by ``decay`` per later draft (1: a sequence's own, kept whole)."""

    decay: float = 1.0
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        for depths in (self.drafted, self.accepted):
            if self.decay != 1.0:
                for j, value in enumerate(depths):
                    depths[j] = value * self.decay
            while len(depths) < drafted:
                depths.append(0.0)
        for j in range(drafted):
            self.drafted[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0

    def rate(self, depth: int) -> float | None:
        """Acceptance at ``depth``; None while too few drafts reached it."""
        if depth >= len(self.drafted) or self.drafted[depth] <= 0 \
                or self.drafted[depth] < MIN_WEIGHT:
            return None
        return self.accepted[depth] / self.drafted[depth]

    def counts(self, depth: int) -> tuple[float, float]:
        """(drafted, accepted) at ``depth``."""
        if depth >= len(self.drafted):
            return 0.0, 0.0
        return self.drafted[depth], self.accepted[depth]


class DraftWorth:
    """Per kind of sequence, how deep its lookup drafts pay; see the module docstring."""

    def __init__(self) -> None:
        self.kinds: dict[bool, DepthCounts] = {False: DepthCounts(DECAY), True: DepthCounts(DECAY)}
        self.proposals: dict[bool, int] = {False: 0, True: 0}  # per kind (EXPLORE_EVERY)

    def verified(self, own: DepthCounts, constrained: bool, forced: int, drafted: int,
                 accepted: int) -> None:
        """A sequence's verified draft (``own``: its counts): ``forced`` grammar tokens, then
        ``drafted - forced`` looked up; ``accepted`` of all of them kept."""
        looked_up = drafted - forced
        if looked_up > 0:
            self.kinds[constrained].add(looked_up, max(0, accepted - forced))
            own.add(looked_up, max(0, accepted - forced))

    def estimate(self, own: DepthCounts, constrained: bool, depth: int) -> float | None:
        """A sequence's chance to have its lookup token at ``depth`` accepted: its own counts
        with the kind's rate as a prior of PRIOR drafts; None while neither says anything."""
        kind = self.kinds[constrained].rate(depth)
        drafted, accepted = own.counts(depth)
        if kind is None and drafted == 0:
            return None
        prior = 1.0 if kind is None else kind  # an unjudged kind: optimistic
        return (accepted + PRIOR * prior) / (drafted + PRIOR)

    def depth(self, own: DepthCounts, constrained: bool, cost: float | None, most: int) -> int:
        """How many looked-up tokens (at most ``most``) a sequence's draft should have when a
        row costs ``cost`` tokens (None: unmeasured, so all of them): the depths before the
        first whose estimate is at most ``cost``, and now and then one more."""
        if cost is None or most <= 0:
            return most
        self.proposals[constrained] += 1
        worth = 0
        while worth < most:
            rate = self.estimate(own, constrained, worth)
            if rate is not None and rate <= cost:
                break
            worth += 1
        if worth < most and self.proposals[constrained] % EXPLORE_EVERY == 0:
            worth += 1
        return worth

    def snapshot(self) -> dict[str, list[float | None]]:
        """Each kind's acceptance by lookup depth (None: not judged yet), for stats()."""
        return {"constrained" if constrained else "free":
                [None if (r := kind.rate(j)) is None else round(r, 3)
                 for j in range(len(kind.drafted))]
                for constrained, kind in self.kinds.items()}
