"""The spec scenario's judge: is a greedy output that differs from the plain run a near-tie flip?

Speculation promises the output without it. The one allowed difference is a near-tie that the
verification rows' kernels round the other way: a verify step computes 1 + k query rows per
sequence and more rows per step, so attention, the linears' row grouping and (past the
crossover of kernels/backend.py) the GEMM path differ from a one-row decode, and the logits
differ in their last bits.

For each greedy request whose output differs from the plain (speculation off) run, the judge
takes the **first differing position** and recomputes the next-token logits after the common
prefix (prompt + the tokens both runs agree on) twice, independently of either run:

- through the **same packed model**, speculation off: the prefix prefilled, then its last token
  in a one-token decode pass, the path the plain run takes at that position;
- through the **dequantized fp32 twin** (the same file with ``quantization="none"``, the quant
  scenario's fidelity reference, bench/quant_scenario.py): the model the packed kernels
  approximate.

The difference is a **near-tie flip** only if both put the two candidate tokens (the plain
run's and the speculating run's) within ``margin`` logits of each other; anything else, and an
output that is a strict prefix of the other (a stop one run made and the other did not), is an
**unexplained difference**: a bug until shown otherwise. The judge compares raw logits, which
is what decides a greedy request without penalties, the spec scenario's kind: a grammar mask
removes tokens but leaves the allowed ones' logits (and both candidates were allowed there).

The margin (:func:`margin_for`, ``--set spec_tie_margin=...`` to fix one) bounds how far the
kernels' rounding can move the gap between two logits. Each path's logits differ from the fp32 model's
only by rounding: the packed GEMV rounds activations to int16 per 32 values (relative error
<= 2^-16 per value, kernels/cpu_ops.py: ActWidth.INT16), the rest is fp32 summation order.
Measured with this module on the bundled SmolLM2-135M (Q4_1 packed against its fp32 twin, 144
greedy positions of the spec workloads, AMD EPYC Zen 4 class, no AMX): every logit within
0.0058 of the twin's (after removing the common offset), the top-2 gap within 0.0019. So one
path moves a gap by at most 2 x 0.0058, and two paths (verify rows, one-row decode) disagree
on it by at most 4 x 0.0058 = 0.023: the margin is 0.025 logits. The same positions' top-2 gaps
were 0.0075 at the smallest, 0.40 at the 10th percentile and 3.4 at the median, so a flip at a
clear winner cannot hide under the margin.

That holds where the packed GEMM (steps of more rows than the GEMV's crossover: prefill chunks,
and the verify steps of several speculating sequences) follows the dequantized product: fp32
tiles (every CPU without AMX) and bf16x3 on AMX. AMX's default, bf16x2, multiplies the weights
rounded to bf16 (docs/quantization.md, the GEMM's precision), and plain bf16 the activations
too: their logits stray further, so their margin is wider (:data:`NEAR_TIE_MARGINS`, each 4x
the largest logit error measured the same way: the bundled model, 91 positions of the three
spec workloads, through a prefill + one-token decode and through one many-row pass, against the
fp32 twin; Intel Xeon with AMX, 4 December 2026: fp32 tiles 0.0048, bf16x3 0.0042, bf16x2
0.114, bf16 0.316). The wider margin is the price of the faster GEMM: on AMX, a user who needs
speculation's outputs to follow plain decoding as closely as on other CPUs runs
``--packed-gemm-precision bf16x3``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagedq.logging import get_logger
from pagedq.params import SamplingParams

log = get_logger("pagedq.bench.spec_judge")

NEAR_TIE_MARGIN = 0.025  # logits: 4x the kernels' largest measured logit error (above)
# per packed GEMM precision (kernels/backend.py: PACKED_PRECISIONS), measured as above
NEAR_TIE_MARGINS = {"fp32": NEAR_TIE_MARGIN, "bf16x3": NEAR_TIE_MARGIN, "bf16x2": 0.5,
                    "bf16": 1.3}
REFERENCE = "the same file dequantized to fp32 (quantization='none')"


class JudgeError(RuntimeError):
    """The judge could not recompute a position (its engine has no room for the prefix)."""


@dataclass(frozen=True)
class Difference:
    """One greedy request whose output differs from the plain run's: where it ran and both
    outputs (token ids after the prompt)."""

    workload: str
    streams: str
    method: str
    job: str
    prompt: list[int]
    got: list[int]  # the speculating run's output
    want: list[int]  # the plain run's output


@dataclass(frozen=True)
class Verdict:
    """The judge's call on one :class:`Difference` (JSON-ready through :meth:`as_dict`)."""

    workload: str
    streams: str
    method: str
    job: str
    position: int  # the first differing output position
    plain_token: int | None  # None: the plain run ended there
    spec_token: int | None  # None: the speculating run ended there
    gap_packed: float | None  # |logit(plain) - logit(spec)|, packed model, one-token pass
    gap_reference: float | None  # the same in the fp32 twin
    margin: float
    near_tie: bool
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first output position where ``got`` and ``want`` differ (the shorter one's length
    when one is a prefix of the other); None when they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))


@torch.inference_mode()
def next_token_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    """The fp32 logits [vocab] of the token after ``ids`` from ``engine``'s model: ``ids[:-1]``
    prefilled, then ``ids[-1]`` in a one-token decode pass (a plain decode's path).

    Runs outside the scheduler on blocks taken from and returned to the engine's pool, never
    registered in its prefix cache; the engine must be idle (between batches)."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.engine.scheduler import SchedulerOutput
    from pagedq.worker.engine.sequence import Request, Sequence

    seq = Sequence(Request("spec-judge", None, list(ids), SamplingParams(max_tokens=1)), 0,
                   list(ids), len(ids))
    if not engine.kv.allocate(seq, len(ids)):
        raise JudgeError(f"the judge's engine has no free KV blocks for {len(ids)} tokens: "
                         "give the spec scenario's engines more (num_kv_blocks)")
    try:
        if len(ids) > 1:
            engine.runner.execute(SchedulerOutput(scheduled=[(seq, len(ids) - 1)]))
            seq.num_computed_tokens = len(ids) - 1
        logits, _ = engine.runner.execute(SchedulerOutput(scheduled=[(seq, 1)]))
        return logits[-1].float().cpu()
    finally:
        engine.kv.free(seq)


def margin_for(engine: Any) -> float:
    """The near-tie margin for ``engine``'s packed GEMM: the widest of the precisions its
    packed projections run (:data:`NEAR_TIE_MARGIN` for float weights: none runs)."""
    if not engine.packed_weights:
        return NEAR_TIE_MARGIN
    precisions = {c.precision for c in engine.backend.packed if c.weight_format != "float32"}
    return max((NEAR_TIE_MARGINS[p] for p in precisions), default=NEAR_TIE_MARGIN)


def gap(logits: torch.Tensor, a: int, b: int) -> float:
    return abs(float(logits[a].double() - logits[b].double()))


LogitsFn = Callable[[list[int]], torch.Tensor]  # token ids -> the next token's logits [vocab]


def engine_logits(engine: Any) -> LogitsFn:
    """``engine``'s next-token logits (:func:`next_token_logits`) as a judge's reference."""
    return functools.partial(next_token_logits, engine)


def judge(diff: Difference, packed: LogitsFn, reference: LogitsFn,
          margin: float = NEAR_TIE_MARGIN) -> Verdict:
    """The verdict on one difference: recompute its first differing position through
    ``packed`` (the served model, speculation off) and ``reference`` (the fp32 twin) and compare
    the two candidate tokens' logits with ``margin``."""
    cut = first_difference(diff.got, diff.want)
    if cut is None:
        raise ValueError(f"job {diff.job}: the outputs are equal, there is nothing to judge")
    plain = diff.want[cut] if cut < len(diff.want) else None
    spec = diff.got[cut] if cut < len(diff.got) else None
    base = dict(workload=diff.workload, streams=diff.streams, method=diff.method, job=diff.job,
                position=cut, plain_token=plain, spec_token=spec, margin=margin)
    if plain is None or spec is None:
        return Verdict(**base, gap_packed=None, gap_reference=None, near_tie=False,
                       why=f"one output is a prefix of the other (lengths {len(diff.got)} "
                           f"speculating, {len(diff.want)} plain): a stop only one run made")
    prefix = diff.prompt + diff.want[:cut]
    ours = gap(packed(prefix), plain, spec)
    theirs = gap(reference(prefix), plain, spec)
    near = ours < margin and theirs < margin
    why = (f"near-tie: logit gap {ours:.3g} (packed) and {theirs:.3g} (fp32 twin), both < "
           f"{margin:g}" if near else
           f"not a near-tie: logit gap {ours:.3g} (packed) / {theirs:.3g} (fp32 twin), margin "
           f"{margin:g}")
    return Verdict(**base, gap_packed=ours, gap_reference=theirs, near_tie=near, why=why)


def judge_all(diffs: list[Difference], packed: Any, make_reference: Callable[[], Any],
              margin: float = NEAR_TIE_MARGIN) -> list[Verdict]:
    """Every difference judged against the ``packed`` engine (speculation off, idle) and the
    engine ``make_reference`` builds (the fp32 twin), built only if there is a difference to
    judge: dequantizing the model costs memory and a minute."""
    if not diffs:
        return []
    ours, theirs = engine_logits(packed), engine_logits(make_reference())
    verdicts = [judge(d, ours, theirs, margin) for d in diffs]
    for v in verdicts:
        (log.info if v.near_tie else log.warning)(
            "spec output differs from off", kind="near-tie flip" if v.near_tie
            else "UNEXPLAINED", job=v.job, method=v.method, position=v.position, why=v.why)
    return verdicts


def tally(verdicts: list[dict[str, Any]], requests: int, differing: int) -> dict[str, int]:
    """Requests, identical, near-tie flips and unexplained differences of one method in one
    cell (``differing`` counts the cell's differences, judged or not)."""
    flips = sum(1 for v in verdicts if v["near_tie"])
    return {"requests": requests, "identical": requests - differing, "near_tie_flips": flips,
            "unexplained": differing - flips}
