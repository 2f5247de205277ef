"""Whether a step speculates, chosen by measuring, per batch size.

Why: a draft's verification rows are nearly free while a step is bound by reading the weights
(a few sequences: one pass over the weights serves 1 + k rows each) and cost their full compute
once the batch is large enough to be compute bound. Where that crossover lies depends on the
machine (its bandwidth against its FLOPs, like the GEMV/GEMM crossover), on the load beside the
worker, and on the workload: an edit job accepts ~4 tokens a step and pays at batch sizes where
an extraction job, accepting ~0.15 extra tokens a step, already loses (forced-on n-gram ran
0.86-0.98x of off from 32 to 64 streams on extraction, measured on a quiet 2-core machine). No
constant serves all three. So the :class:`SpecGovernor` keeps, per batch-size bucket (1, 2-3,
4-7, ... running sequences, like the ThreadGovernor's step sizes in threads.py), the decode
throughput of steps that speculated and of steps that did not (tokens produced, accepted drafts
included, per running sequence and second of the whole step: drafting, the forward pass and
verification), runs the
better one, and tries the other again after EXPLORE_EVERY steps, doubling the wait after each
try it lost (up to EXPLORE_AT_MOST), so it follows the workload and the machine's load.

Only decode-only steps are measured: a prefill chunk in the step costs the same either way and
would blur the comparison. A step that was allowed to speculate but verified no draft (no
sequence's lookup matched) ran exactly a plain step's rows, so it is measured as a plain step:
plain decoding's figure comes for free wherever such steps occur (one stream on extraction: a
third of its steps), and a periodic try of plain decoding is skipped while that figure is
fresh. Tries are what exploring costs: at one stream on extraction the tries of plain decoding
took 0.4 of the 2.2 tokens a step that forced-on speculation makes (bench, 2 jobs). The
comparison is still the right one: speculating mode mixes drafted steps and draftless (plain)
ones, so it beats plain decoding exactly when its drafted steps do.

Tokens count per running sequence because a bucket spans batch sizes up to 2x apart: while the
weights' bandwidth bounds the step (where speculation is decided) its time barely grows with the
batch, so tokens per step grow with it and a try at 7 sequences would beat the running mean of
steps at 4 for that reason alone; per sequence, the two compare like for like. A try lasts
TRY_STEPS steps (one step's acceptance is too noisy to judge by). A step that took over
OUTLIER times what its query rows typically cost counts as OUTLIER times that, unless the step
before it was slow too: on a shared or virtual machine a garbage collection or the host taking
the core adds tens of milliseconds to a ~7 ms step now and then, and one such step, smoothed in
at full weight, moved a choice's mean by 20-60% and started a try of the losing choice (a try
summed over its steps counts each at most OUTLIER times their median cost per row). Per row,
not per step: a drafted step's time grows with its draft rows, and its tokens with the drafts
it accepts, so the longest drafted steps are also the most productive ones. Capped per step,
they kept their tokens and lost up to half their time: at 8 streams on open chat (Zen 5, 2
threads) speculation read 154-161 tokens a second and sequence against plain decoding's 145,
while its drafted steps ran 1029-1088 tokens a second against plain's 1107-1227 (the engine
0.92x off). Per step the governor does a few float operations: no per-token work.

Per bucket it also fits what one more draft row adds to a drafted step (``draft_row_cost``, in
plain decoding's tokens), which draft_worth.py weighs each lookup depth's acceptance against.

``disable_by_batch_size`` stays a hard cap above which no step speculates, and ``adaptive=False``
(``speculative_config``) turns the governor off: every step below the cap speculates, and
no draft is cut (nothing measures a row's cost).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedq.worker.engine.threads import size_class

# measured steps of one bucket before the other choice is tried again. Short, because the
# first figures are the least reliable: a new engine's first steps with drafts meet row counts
# its kernels have not run yet (measured: a smoke run's first edit batch chose plain decoding
# at 1 stream, where drafts make 3.75 tokens a step); the back-off makes later tries rare.
EXPLORE_EVERY = 8
EXPLORE_AT_MOST = 512  # ... doubling after each try it lost, up to this many
TRY_STEPS = 4  # steps one try of the other choice runs before it is judged
SMOOTHING = 0.2  # weight of the newest step in the chosen choice's running means
REACT = 1.1  # the other choice's last rate this many times the chosen's: try it at once
# a step counts at most this many times its choice's typical step: a pause that is not the
# step's own (a garbage collection, the host taking the core) must not decide for ~10 steps
OUTLIER = 2.0
# weight a drafted step's verdict keeps per later drafted step (see SpecGovernor.spec_pays)
GAIN_DECAY = 0.95
FIT_DECAY = 0.95  # ... and its draft rows' seconds in the fit of a draft row's cost (_Fit)


def bucket_name(size: int) -> str:
    """A size class's batch sizes as text: 1 -> "1", 2 -> "2-3", 3 -> "4-7", ..."""
    low, high = 1 << (size - 1), (1 << size) - 1
    return str(low) if low == high else f"{low}-{high}"


@dataclass
class _Rate:
    """Running means of one choice's steps: tokens produced per running sequence, seconds."""

    tokens: float = 0.0
    seconds: float = 0.0
    row_seconds: float = 0.0  # seconds per query row: what a typical step of n rows costs
    measured: bool = False
    over: bool = False  # the latest step took over OUTLIER times the mean (see _follow)

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Fit:
    """Least squares of y = a + b x over decayed steps (weight FIT_DECAY a later step): b is
    what one more draft row adds to a drafted step, a what drafting at all adds (looking up
    every sequence's draft, verifying), which the governor's speculate-or-not judges and the
    rows' worth (draft_worth.py) must not."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = FIT_DECAY
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y

    def slope(self) -> float | None:
        """b; None before any step. Steps all of one draft size (no spread to fit): y / x."""
        if self.w <= 0:
            return None
        var = self.sxx / self.w - (self.sx / self.w) ** 2
        if var < 0.25:  # under half a row of spread
            return max(0.0, self.sy / self.sx)
        return max(0.0, (self.sxy / self.w - self.sx * self.sy / self.w ** 2) / var)


@dataclass
class _Bucket:
    rates: dict[bool, _Rate] = field(default_factory=lambda: {True: _Rate(), False: _Rate()})
    chosen: bool | None = None  # the better choice so far (None: not both measured yet)
    steps: int = 0  # measured steps
    interval: int = EXPLORE_EVERY  # steps between two tries of the other choice
    next_try: int = EXPLORE_EVERY
    trying: bool | None = None  # the choice a try in progress runs
    try_tokens: float = 0.0
    try_times: list[tuple[float, int]] = field(default_factory=list)  # the try's (seconds, rows)
    free_tokens: float = 0.0  # draftless speculating steps summed while plain is unmeasured
    free_times: list[tuple[float, int]] = field(default_factory=list)
    last_free: int = -1  # ``steps`` at the latest draftless speculating step
    # drafted steps' tokens, and what plain decoding would have made in their time (at its
    # rate then), both decayed by GAIN_DECAY a drafted step: SpecGovernor.spec_pays
    gain_tokens: float = 0.0
    gain_plain: float = 0.0
    turnover: int = 1  # sequences that must finish before plain decoding's choice is re-tried
    finished_mark: int = 0  # SpecGovernor.finished at the latest try of speculation
    draft_rows: _Fit = field(default_factory=lambda: _Fit())  # a draft row's added seconds


def _most(rows: int, row_seconds: float) -> float:
    """The most seconds a step of ``rows`` query rows counts for: OUTLIER times what its rows
    typically cost (``row_seconds`` each; unknown yet: no limit)."""
    return OUTLIER * rows * row_seconds if row_seconds > 0 else float("inf")


def _row_cost(bucket: _Bucket) -> float | None:
    """A draft row's seconds in tokens of plain decoding (SpecGovernor.draft_row_cost)."""
    plain, slope = bucket.rates[False], bucket.draft_rows.slope()
    if slope is None or not (plain.measured and plain.row_seconds > 0):
        return None
    return slope / plain.row_seconds


def _measure(rate: _Rate, tokens: float, steps: list[tuple[float, int]]) -> None:
    """Set a choice's figures from a few steps' (seconds, rows): the mean tokens and seconds
    of a step, each step counted at most OUTLIER times the median seconds per row of them."""
    per_row = statistics.median(t / rows for t, rows in steps)
    capped = [min(t, _most(rows, per_row)) for t, rows in steps]
    rate.tokens = tokens / len(steps)
    rate.seconds = sum(capped) / len(steps)
    rate.row_seconds = sum(capped) / sum(rows for _, rows in steps)
    rate.measured = True


def _follow(rate: _Rate, tokens: float, seconds: float, rows: int) -> None:
    """Move a choice's running means towards a new step of ``rows`` query rows. A step over
    OUTLIER times what its rows typically cost counts as OUTLIER times that unless the step
    before was over too: one paused step moves the means little, a lasting change (the
    machine got busy, the workload changed) from its second step on."""
    most = _most(rows, rate.row_seconds)
    over = seconds > most
    if over and not rate.over:
        seconds = most
    rate.over = over
    rate.tokens += SMOOTHING * (tokens - rate.tokens)
    rate.seconds += SMOOTHING * (seconds - rate.seconds)
    rate.row_seconds += SMOOTHING * (seconds / rows - rate.row_seconds)


def _drafted(bucket: _Bucket, tokens: float, seconds: float, rows: int, batch: int) -> None:
    """A drafted step of ``batch`` sequences and ``rows`` query rows, priced against plain
    decoding at its rate now (a pause capped per row as in _follow; nothing while plain
    decoding is unmeasured): its tokens and what plain decoding would have made in its time
    join the bucket's sums (SpecGovernor.spec_pays), and its seconds beyond plain's rows of
    the same batch join the fit of what a draft row adds (SpecGovernor.draft_row_cost)."""
    plain = bucket.rates[False]
    if not plain.measured:
        return
    seconds = min(seconds, _most(rows, bucket.rates[True].row_seconds))
    bucket.gain_tokens = GAIN_DECAY * bucket.gain_tokens + tokens
    bucket.gain_plain = GAIN_DECAY * bucket.gain_plain + seconds * plain.per_second
    if rows > batch:
        bucket.draft_rows.add(rows - batch, seconds - plain.row_seconds * batch)


class SpecGovernor:
    """Lets a step speculate when speculation has produced more tokens per second than plain
    decoding for batches of its size, and never at ``max_batch`` running sequences or more.

    ``adaptive=False``: no measuring, every step below ``max_batch`` speculates. ``clock`` is
    injectable so tests drive the decisions with a fake one.
    """

    def __init__(self, max_batch: int, adaptive: bool = True, explore_every: int = EXPLORE_EVERY,
                 try_steps: int = TRY_STEPS, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.max_batch = max_batch
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.try_steps = try_steps
        self.clock = clock
        self.by_size: dict[int, _Bucket] = {}
        self.pending: tuple[_Bucket, bool, int, float] | None = None  # the step under way
        self.finished = 0  # sequences ended (sequence_finished): the batch's turnover

    def decide(self, batch: int) -> bool:
        """Whether a step running ``batch`` sequences speculates; starts timing the step (a
        step :meth:`record` does not follow is simply not measured)."""
        self.pending = None
        if batch < 1 or batch >= self.max_batch:  # none decoding yet (a first prefill), or capped
            return False
        if not self.adaptive:
            return True
        bucket = self.by_size.get(size_class(batch))
        if bucket is None:
            size = size_class(batch)
            bucket = self.by_size[size] = _Bucket(
                interval=self.explore_every, next_try=self.explore_every,
                turnover=1 << (size - 1), finished_mark=self.finished)
        speculate = self.pick(bucket)
        self.pending = (bucket, speculate, batch, self.clock())
        return speculate

    def record(self, tokens: int, decode_only: bool = True, drafted: bool = True,
               rows: int | None = None) -> None:
        """The step :meth:`decide` began has ended having produced ``tokens`` tokens from
        ``rows`` query rows (default: one a running sequence, a plain decode step); a step
        with a prefill chunk in it (``decode_only`` false) is not measured; a speculating step
        that verified no draft (``drafted`` false) is measured as the plain step it was."""
        if self.pending is None:
            return
        bucket, speculate, batch, start = self.pending
        self.pending = None
        if not (decode_only and tokens > 0):
            return
        step = (self.clock() - start, max(1, rows or batch))
        if speculate and drafted:
            _drafted(bucket, tokens / batch, *step, batch)
        if speculate and not drafted:
            self.observe_free(bucket, tokens / batch, step)
        else:
            self.observe(bucket, speculate, tokens / batch, step)

    def draft_row_cost(self) -> float | None:
        """What one draft row adds to the step :meth:`decide` began, in tokens of plain
        decoding (its seconds per row), for draft_worth.py; None while either is unmeasured.
        ~0.12 at one stream, where a step reads the weights for any number of rows, ~0.55 at 8
        (Zen 5, 2 threads), where each row costs its products."""
        return None if self.pending is None else _row_cost(self.pending[0])

    def sequence_finished(self) -> None:
        """A sequence ended. Once as many have ended as a bucket's smallest batch (its batch
        has turned over: new jobs, maybe another workload), a bucket decoding plainly tries
        speculation again at once, whatever its back-off, and a speculating one halves its
        drafted steps' sums (spec_pays), so the new jobs' steps outweigh the old ones sooner.
        Why: the back-off grows while drafts do not pay, and the batch sizes where a workload
        sits spend few steps in each bucket (8 edit jobs speculating: ~20 steps of 8-15
        sequences in a batch), so a worker that had settled on plain decoding over extraction
        jobs never tried drafts again on the edit jobs after them (8 streams: edit 1.08x off
        against 1.49x, Zen 5); the other way, open chat after edit kept speculating through
        its first round. A try per turnover costs a few steps a batch where drafts lose."""
        self.finished += 1

    def pick(self, bucket: _Bucket) -> bool:
        """A try in progress goes on; an unmeasured choice is tried (speculation first); then
        the better choice, and the other one once ``next_try`` is reached (or, decoding
        plainly, once the batch has turned over: sequence_finished)."""
        if bucket.trying is not None:
            return bucket.trying
        on, off = bucket.rates[True], bucket.rates[False]
        if self.finished - bucket.finished_mark >= bucket.turnover:
            if bucket.chosen is False:
                bucket.next_try = min(bucket.next_try, bucket.steps)
            else:  # speculating: the jobs before weigh half against the new ones' steps
                bucket.gain_tokens, bucket.gain_plain = bucket.gain_tokens / 2, bucket.gain_plain / 2
                bucket.finished_mark = self.finished
        if not on.measured:
            bucket.trying = True
            bucket.finished_mark = self.finished
            return True
        if not off.measured:
            if self._fresh_plain(bucket):  # draftless steps are measuring plain decoding
                return True
            bucket.trying = False
            return False
        if bucket.steps >= bucket.next_try:
            if bucket.chosen and self._fresh_plain(bucket):  # no plain try needed
                if not self.spec_pays(bucket):
                    bucket.chosen, bucket.interval = False, self.explore_every
                bucket.next_try = bucket.steps + bucket.interval
                return bool(bucket.chosen)
            bucket.trying = not bucket.chosen
            if bucket.trying:
                bucket.finished_mark = self.finished
            return bucket.trying
        return bool(bucket.chosen)

    @staticmethod
    def spec_pays(bucket: _Bucket) -> bool:
        """Whether speculation beats plain decoding in ``bucket``: its drafted steps' tokens
        against the tokens plain decoding made in the same time at its rate of that moment,
        summed over the bucket's recent drafted steps (GAIN_DECAY), tries and chosen runs alike.

        Why not the two running means: a drafted step's yield swings 1-4x from step to step
        (8 streams on open chat: 8-34 tokens in 7-46 ms), so a four-step try judged alone,
        which then stood for its choice until the next try, was mostly luck, and a lucky one
        kept speculation chosen where its drafted steps lost ~10% (0.92x off on chat at 8
        streams, Zen 5). Summing over many tries steadies it, and pricing each step at plain's
        rate of its own moment keeps the sum fair while the machine's speed drifts (a VM's rate
        moved 1.4x within minutes): the first measurement of both still compares the means."""
        on, off = bucket.rates[True], bucket.rates[False]
        if bucket.gain_plain > 0:
            return bucket.gain_tokens >= bucket.gain_plain
        return on.per_second >= off.per_second

    def _fresh_plain(self, bucket: _Bucket) -> bool:
        """Whether a draftless speculating step measured plain decoding within the bucket's
        current try interval."""
        return bucket.last_free >= 0 and bucket.steps - bucket.last_free < bucket.interval

    def observe(self, bucket: _Bucket, speculate: bool, tokens: float,
                step: tuple[float, int]) -> None:
        """A measured step (``tokens``: per running sequence; ``step``: its seconds and query
        rows). A try sums its steps and, once
        done, replaces its choice's (stale) means: it measures the machine and the workload as
        they are now; the other choice takes over if it is now faster (spec_pays), else its
        next try waits twice as long. The chosen choice's
        means follow its steps smoothly, and when they fall REACT times below the other
        choice's last rate (the load or the workload changed) the other is tried at once."""
        bucket.steps += 1
        if speculate == bucket.trying:
            bucket.try_tokens += tokens
            bucket.try_times.append(step)
            if len(bucket.try_times) >= self.try_steps:
                self._end_try(bucket, speculate)
            return
        rate, other = bucket.rates[speculate], bucket.rates[not speculate]
        _follow(rate, tokens, *step)
        if other.per_second > REACT * rate.per_second:
            self._react(bucket)
        elif speculate and bucket.chosen and not self.spec_pays(bucket):
            # the drafted steps' sum turned (the workload changed, less than REACT): plain
            # decoding's try at once, not at the back-off's next one
            bucket.next_try = min(bucket.next_try, bucket.steps)

    def observe_free(self, bucket: _Bucket, tokens: float, step: tuple[float, int]) -> None:
        """A speculating step that verified no draft: a plain step's rows, measured as one.
        Until plain decoding has a figure, TRY_STEPS of them make it (as a try would); then
        they keep it current, and plain decoding faster than speculation by REACT makes the
        next :meth:`pick` compare the two at once."""
        bucket.steps += 1
        bucket.last_free = bucket.steps
        plain = bucket.rates[False]
        if not plain.measured:
            bucket.free_tokens += tokens
            bucket.free_times.append(step)
            if len(bucket.free_times) >= self.try_steps:
                _measure(plain, bucket.free_tokens, bucket.free_times)
                on = bucket.rates[True]
                if on.measured and bucket.chosen is None:
                    bucket.chosen = self.spec_pays(bucket)
                    bucket.next_try = bucket.steps + bucket.interval
            return
        _follow(plain, tokens, *step)
        if bucket.chosen and plain.per_second > REACT * bucket.rates[True].per_second:
            self._react(bucket)

    @staticmethod
    def _react(bucket: _Bucket) -> None:
        """The chosen choice's running means fell REACT times below the other's: try the
        other at once. Where speculation was chosen, its drafted steps' sum (spec_pays) is
        dropped: it holds the workload from before the change, and its slow decay would keep
        speculation for tens of steps after drafts stopped paying; the try's means judge."""
        bucket.next_try = min(bucket.next_try, bucket.steps)
        if bucket.chosen:
            bucket.gain_tokens = bucket.gain_plain = 0.0

    def _end_try(self, bucket: _Bucket, tried: bool) -> None:
        rate = bucket.rates[tried]
        _measure(rate, bucket.try_tokens, bucket.try_times)
        bucket.trying, bucket.try_tokens, bucket.try_times = None, 0.0, []
        on, off = bucket.rates[True], bucket.rates[False]
        if not (on.measured and off.measured):
            return
        if bucket.chosen is None:  # both measured for the first time
            bucket.chosen = self.spec_pays(bucket)
        elif tried != bucket.chosen:
            if self.spec_pays(bucket) == tried:
                bucket.chosen, bucket.interval = tried, self.explore_every
            else:
                bucket.interval = min(2 * bucket.interval, EXPLORE_AT_MOST)
        bucket.next_try = bucket.steps + bucket.interval

    def snapshot(self) -> dict[str, Any]:
        """The governor's state for stats(): which buckets speculate now, and per bucket the
        measured tokens per second and running sequence with and without speculation, and
        what a draft row costs in plain decoding's tokens."""
        def figure(rate: _Rate) -> float | None:
            return round(rate.per_second, 3) if rate.measured else None

        buckets = {bucket_name(size): {
            "speculate": b.chosen, "seq_tok_s_spec": figure(b.rates[True]),
            "seq_tok_s_plain": figure(b.rates[False]), "steps": b.steps,
            "draft_row_cost": None if (c := _row_cost(b)) is None else round(c, 3)}
            for size, b in sorted(self.by_size.items())}
        return {"adaptive": self.adaptive, "max_batch": self.max_batch,
                "speculating": [name for name, b in buckets.items() if b["speculate"]],
                "buckets": buckets}
