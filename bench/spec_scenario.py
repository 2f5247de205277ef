"""The ``spec`` scenario: speculative decoding (n-gram and suffix drafts) against none.

Three workloads of chat prompts on the run's model, each at ``spec_streams`` concurrent
streams, each batch served by three engines built side by side (speculation off, ``ngram``,
``suffix``) in turn, round after round, so a drift of the shared machine's speed lands on all
three alike:

- **extraction**: a short record made from the seed, "return these fields as JSON", with a
  json_schema (the structured scenario's schema);
- **edit**: "repeat this paragraph with every date in ISO format";
- **chat**: open questions.

All requests are greedy, so every engine must produce the same tokens. Each output that
differs from off's is judged (bench/spec_judge.py): its first differing position recomputed
through the packed model (speculation off, a one-token pass) and the dequantized fp32 twin, a
near-tie flip only if both put the two tokens within ``spec_tie_margin`` logits, else an
**unexplained difference** (the JSON's ``unexplained_differences``, a loud line in the report).
Per workload and stream count: decode tok/s (tokens after the last first token, over the time
after it, like the decode sweep), the acceptance rate, and tokens per decode step per job
(distinct step timestamps of its tokens: a machine-independent figure, the ceiling of the
speed-up).

The extraction workload at ``spec_learning_streams`` (1) runs ``spec_learning_rounds`` (64)
rounds, so the suffix engine, which drafts from earlier requests' outputs too, has seen 50
extraction jobs before that cell's last rounds: its tokens per step on that cell's jobs 50 and
later are compared with ngram's (jobs of other cells may not speculate at all: see learning()).

``spec_threshold_streams``: ngram with speculation forced on at every batch size against off,
on each of ``spec_threshold_workloads`` (extraction by default), ``spec_threshold_rounds``
alternated rounds each, to find where verification rows stop paying; with
``spec_threshold_governed`` (default on) a third engine runs ngram with the governor deciding
per batch size and no cap (worker/engine/spec_governor.py), one engine for the whole sweep, so
it shows whether the governor finds each workload's crossover: it should run near the better of
off and forced-on at every stream count. The grid's ngram and suffix engines run the shipped
default (the governor under ``disable_by_batch_size``; ``spec_adaptive=false`` forces them on
below the cap). ``spec_streams`` takes
any list of stream counts (``spec_rounds`` pairs with it, its last value repeating), and
``spec_workloads`` a subset of the workloads, so a sweep such as ``--set
spec_streams=32,40,48,56,64 --set spec_workloads=extraction`` fits in one run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pagedq.bench import driver, spec_judge
from pagedq.bench.context import BenchContext, Unavailable
from pagedq.bench.structured_scenario import SCHEMA, SampledRequest, record
from pagedq.logging import get_logger
from pagedq.params import SamplingParams

log = get_logger("pagedq.bench.spec")

METHODS = ("off", "ngram", "suffix")
WORKLOADS = ("extraction", "edit", "chat")
NEVER_OFF = 1 << 30  # disable_by_batch_size for the threshold sweep: speculation at any batch
THRESHOLD_METHODS = ("ngram", "governed")  # forced-on ngram, ngram under the governor
TARGETS = {"1": 2.0, "8": 1.5, "64": 0.97, "chat": 0.97}
LEARNED_AFTER = 50  # suffix >= ngram on extraction from this job on

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SUBJECTS = ["The lease", "The audit", "The shipment", "Her contract", "The survey", "The trial",
            "The merger", "The renovation", "His visa", "The warranty"]
VERBS = ["started on", "was signed on", "ended on", "was delayed until", "was reviewed on",
         "was renewed on", "was filed on", "closed on"]
TOPICS = ["a lighthouse keeper", "learning to cook", "the history of bicycles", "a rainy city",
          "how volcanoes form", "a friendly robot", "saving money", "the night sky",
          "training for a marathon", "an old library", "growing tomatoes", "a trip to the sea"]
ASKS = ["Write a short story about {}.", "What should a beginner know about {}?",
        "Tell me something surprising about {}.", "Write a poem about {}.",
        "Explain {} to a child."]


def _date(rng: random.Random) -> str:
    month, day, year = rng.choice(MONTHS), rng.randint(1, 28), rng.randint(1995, 2030)
    return rng.choice([f"{month} {day}, {year}", f"{day} {month} {year}"])


def extraction_text(rng: random.Random) -> str:
    return ("Return these fields of the record as JSON: name, age, email (null if none), role, "
            "city, skills.\n" + record(rng))


def edit_text(rng: random.Random) -> str:
    sentences = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {_date(rng)}."
                 for _ in range(rng.randint(3, 4))]
    return ("Repeat this paragraph with every date in ISO format (YYYY-MM-DD), changing "
            "nothing else:\n\n" + " ".join(sentences))


def chat_text(rng: random.Random) -> str:
    return rng.choice(ASKS).format(rng.choice(TOPICS))


TEXTS = {"extraction": extraction_text, "edit": edit_text, "chat": chat_text}


def jobs(engine: Any, workload: str, count: int, seed: int, max_tokens: int,
         tag: str) -> list[SampledRequest]:
    """``count`` greedy chat requests of ``workload`` (the extraction ones with the schema)."""
    rng = random.Random(f"{workload}-{seed}")
    out = []
    for i in range(count):
        prompt = engine.apply_chat_template([{"role": "user", "content": TEXTS[workload](rng)}])
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=(
            {"json": SCHEMA} if workload == "extraction" else None))
        out.append(SampledRequest(f"{tag}-{i}", prompt, max_tokens, params))
    return out


@dataclass
class Batch:
    """One batch served by one engine: its decode rate and what its drafts did."""

    method: str
    tokens: int
    decode_tokens: int
    decode_s: float
    drafted: int
    accepted: int
    steps_per_job: dict[str, int]
    tokens_per_job: dict[str, int]
    outputs: dict[str, list[int]] = field(repr=False)
    prompts: dict[str, list[int]] = field(default_factory=dict, repr=False)


def serve_batch(engine: Any, method: str, requests: list[SampledRequest]) -> Batch:
    before = engine.stats()
    run = driver.serve(engine, requests, record_kv=False, keep_outputs=True)
    after = run.stats_after
    times = run.timeline.requests
    prompt_done = max(r.token_times[0] for r in times.values())
    last = max(r.token_times[-1] for r in times.values())
    decode_tokens = sum(sum(1 for t in r.token_times if t > prompt_done) for r in times.values())

    def delta(key: str) -> int:
        return int(after.get(key, 0) or 0) - int(before.get(key, 0) or 0)

    return Batch(method=method, tokens=run.timeline.output_tokens, decode_tokens=decode_tokens,
                 decode_s=last - prompt_done, drafted=delta("spec_decode_num_draft_tokens"),
                 accepted=delta("spec_decode_num_accepted_tokens"),
                 steps_per_job={k: len(set(r.token_times)) for k, r in times.items()},
                 tokens_per_job={k: len(r.token_times) for k, r in times.items()},
                 outputs=run.outputs,
                 prompts={r.request_id: list(r.prompt_token_ids) for r in requests})


def measure(bench: BenchContext) -> None:
    """The scenario (``bench.results["spec"]``)."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.models.loader import load_tokenizer

    if load_tokenizer(bench.model_dir) is None:
        raise Unavailable("the spec workloads are chat prompts: this model has no tokenizer")
    c = bench.config
    for name in ("spec_workloads", "spec_threshold_workloads"):
        unknown = sorted(set(getattr(c, name) or ()) - set(WORKLOADS))
        if unknown:
            raise ValueError(f"{name}: unknown {unknown}; choose from {list(WORKLOADS)}")
    engines = build_engines(bench)
    grid: dict[str, dict[str, list[list[Batch]]]] = {}
    for workload in (w for w in WORKLOADS if w in c.spec_workloads):
        grid[workload] = {}
        for streams in c.spec_streams:
            rounds = rounds_for(c.spec_streams, c.spec_rounds, streams)
            if workload == "extraction" and streams == c.spec_learning_streams:
                rounds = max(rounds, c.spec_learning_rounds)
            grid[workload][str(streams)] = run_rounds(bench, engines, workload, streams, rounds)
    threshold, threshold_rounds, governor = sweep_threshold(bench, engines["off"])
    margin = (spec_judge.margin_for(engines["off"]) if c.spec_tie_margin is None
              else c.spec_tie_margin)
    verdicts = judge_differences(bench, engines["off"], differences(grid, threshold_rounds),
                                 margin)
    bench.results["spec"] = {"grid": grid, "threshold": threshold,
                             "learning_streams": c.spec_learning_streams,
                             "judged": [v.as_dict() for v in verdicts],
                             "tie_margin": margin,
                             "suffix_stats": engines["suffix"].stats(),
                             "disable_by_batch_size": engines["ngram"].drafter.config
                             .disable_by_batch_size,
                             "governors": {"grid_ngram": engines["ngram"].drafter.governor
                                           .snapshot(), "threshold_governed": governor}}


def rounds_for(streams_list: tuple[int, ...], rounds_list: tuple[int, ...], streams: int) -> int:
    """The rounds of ``streams``: ``spec_rounds`` pairs with ``spec_streams`` by position, its
    last value repeating for stream counts past its end (so a sweep needs one value)."""
    if not rounds_list:
        return 1
    i = streams_list.index(streams)
    return rounds_list[min(i, len(rounds_list) - 1)]


def threshold_name(workload: str) -> str:
    """The judge's workload name for a threshold-sweep batch (``threshold`` on extraction)."""
    return "threshold" if workload == "extraction" else f"threshold-{workload}"


def differences(grid: dict[str, dict[str, list[list[Batch]]]],
                threshold_rounds: dict[str, dict[str, list[list[Batch]]]]
                ) -> list[spec_judge.Difference]:
    """Every greedy job whose output differs from off's in the same round: the grid's cells
    and the threshold sweep's (as workload ``threshold_name(workload)``)."""
    cells = [(w, s, rounds) for w, per in grid.items() for s, rounds in per.items()]
    cells += [(threshold_name(w), s, rounds) for w, per in threshold_rounds.items()
              for s, rounds in per.items()]
    out = []
    for workload, streams, rounds in cells:
        for batches in rounds:
            off = pick(batches, "off")
            out += [spec_judge.Difference(workload, streams, b.method, job, off.prompts[job],
                                          b.outputs[job], want)
                    for b in batches if b.method != "off"
                    for job, want in off.outputs.items() if b.outputs[job] != want]
    return out


def judge_differences(bench: BenchContext, off: Any, diffs: list[spec_judge.Difference],
                      margin: float) -> list[spec_judge.Verdict]:
    """The judge's verdict on every difference, against the off engine (idle now) and the
    dequantized fp32 twin, built only when there is a difference to judge."""
    def twin() -> Any:
        longest = max(len(d.prompt) + len(d.want) for d in diffs)
        log.info("spec judge: building the fp32 twin", differences=len(diffs))
        return bench.engine(quantization="none", speculative_config=None, max_num_seqs=1,
                            num_kv_blocks=bench.blocks_for(longest) + 2)

    return spec_judge.judge_all(diffs, off, twin, margin)


def build_engines(bench: BenchContext) -> dict[str, Any]:
    """Off, ngram and suffix engines on the same knobs (speculation's defaults but for
    ``num_speculative_tokens``, ``adaptive`` and, when set, ``disable_by_batch_size``)."""
    extra: dict[str, Any] = {"adaptive": bench.config.spec_adaptive}
    if bench.config.spec_disable_by_batch_size:
        extra["disable_by_batch_size"] = bench.config.spec_disable_by_batch_size
    return {"off": spec_engine(bench, None), **{m: spec_engine(bench, m, **extra)
                                                for m in ("ngram", "suffix")}}


def spec_engine(bench: BenchContext, method: str | None, **spec: Any) -> Any:
    """An engine holding the largest batch the scenario runs, speculating with ``method``."""
    c = bench.config
    top = max((*c.spec_streams, *(c.spec_threshold_streams or ())))
    k = c.spec_num_speculative_tokens
    per_seq = bench.blocks_for(c.spec_prompt_tokens_max + c.spec_max_tokens + k + 1) + 1
    config = None if method is None else {"method": method, "num_speculative_tokens": k, **spec}
    return bench.engine(speculative_config=config, max_num_seqs=top,
                        num_kv_blocks=top * per_seq + 16,
                        max_num_batched_tokens=max(c.max_num_batched_tokens, top * (k + 1)))


def run_rounds(bench: BenchContext, engines: dict[str, Any], workload: str, streams: int,
               rounds: int) -> list[list[Batch]]:
    """``rounds`` batches of ``streams`` new jobs, each served by off, ngram, suffix in turn,
    the order rotating by one each round.

    Why rotate: the VM's speed drifts within a round (off's 64-stream rate rose 1100 -> 1270 ->
    1520 tok/s over three consecutive rounds of the same workload, Zen 5), so in a fixed order
    the last engine was judged on a different machine than the first every time."""
    c = bench.config
    out = []
    for r in range(rounds):
        reqs = jobs(engines["off"], workload, streams, c.seed + 1000 * streams + r,
                    c.spec_max_tokens, f"spec-{workload}-{streams}-{r}")
        out.append(serve_round(engines, reqs, r))
        log.info("spec batch", workload=workload, streams=streams, round=r,
                 **{f"{b.method}_tok_s": round(rate([b]), 1) for b in out[-1]})
    return out


def serve_round(engines: dict[str, Any], reqs: list[SampledRequest], r: int) -> list[Batch]:
    """Round ``r``'s jobs served by every engine, the order rotated by ``r`` (run_rounds)."""
    names = list(engines)
    turn = names[r % len(names):] + names[:r % len(names)]
    return [serve_batch(engines[m], m, reqs) for m in turn]


def sweep_threshold(bench: BenchContext, off: Any) -> tuple[
        list[dict[str, Any]], dict[str, dict[str, list[list[Batch]]]], dict[str, Any] | None]:
    """Off against ngram with speculation at every batch size (and, with
    ``spec_threshold_governed``, ngram under the governor with no cap), on batches of each
    ``spec_threshold_workloads``, ``spec_threshold_rounds`` rounds alternated per stream count:
    the rows, the batches (whose differing outputs the judge sees) and the governor's state at
    the end."""
    c = bench.config
    if not c.spec_threshold_streams:
        return [], {}, None
    engines = {"off": off,
               "ngram": spec_engine(bench, "ngram", disable_by_batch_size=NEVER_OFF,
                                    adaptive=False)}
    if c.spec_threshold_governed:
        engines["governed"] = spec_engine(bench, "ngram", disable_by_batch_size=NEVER_OFF,
                                          adaptive=True)
    rows, batches = [], {}
    for workload in c.spec_threshold_workloads or ("extraction",):
        batches[workload] = {}
        for streams in c.spec_threshold_streams:
            rounds = []
            for r in range(max(1, c.spec_threshold_rounds)):
                reqs = jobs(off, workload, streams, c.seed + 7 + streams + 1000 * r,
                            c.spec_max_tokens, f"spec-threshold-{workload}-{streams}-{r}")
                rounds.append(serve_round(engines, reqs, r))
            batches[workload][str(streams)] = rounds
            rows.append(threshold_row(workload, streams, rounds))
            log.info("spec threshold", workload=workload, streams=streams,
                     **{f"{m}_ratio": round(rows[-1][f"{m}_ratio"], 3)
                        for m in THRESHOLD_METHODS if f"{m}_ratio" in rows[-1]})
    governed = engines.get("governed")
    return rows, batches, governed.drafter.governor.snapshot() if governed else None


def threshold_row(workload: str, streams: int, rounds: list[list[Batch]]) -> dict[str, Any]:
    """One threshold row: off's rate, and per speculating engine its rate, ratio to off (over
    all rounds and per round), acceptance and tokens per step (``ngram``: forced on; the
    governed engine's as ``governed_*``)."""
    m = by_method(rounds)
    off = rate(m["off"])
    row: dict[str, Any] = {"workload": workload, "streams": streams, "rounds": len(rounds),
                           "off_tok_s": off,
                           "identical": all(b.outputs == r[0].outputs for r in rounds for b in r),
                           "differing": flips(rounds).get("ngram", 0)}
    for method in THRESHOLD_METHODS:
        if method not in m:
            continue
        row.update({f"{method}_tok_s": rate(m[method]), f"{method}_ratio": rate(m[method]) / off,
                    f"{method}_round_ratios": [rate([pick(r, method)]) / rate([pick(r, "off")])
                                               for r in rounds],
                    f"{method}_acceptance_rate": acceptance(m[method]),
                    f"{method}_tokens_per_step": tokens_per_step(m[method]),
                    f"{method}_differing": flips(rounds).get(method, 0)})
    # the names the rows had before the governed engine joined them (forced-on ngram)
    row.update({"ratio": row["ngram_ratio"], "round_ratios": row["ngram_round_ratios"],
                "acceptance_rate": row["ngram_acceptance_rate"],
                "tokens_per_step": row["ngram_tokens_per_step"]})
    return row


# -- figures ------------------------------------------------------------------------------------
def rate(batches: list[Batch]) -> float:
    """Decode tok/s over batches: their decode tokens over their decode seconds."""
    return sum(b.decode_tokens for b in batches) / max(sum(b.decode_s for b in batches), 1e-9)


def acceptance(batches: list[Batch]) -> float | None:
    drafted = sum(b.drafted for b in batches)
    return sum(b.accepted for b in batches) / drafted if drafted else None


def tokens_per_step(batches: list[Batch], jobs_from: int = 0,
                    order: list[str] | None = None) -> float | None:
    """Decode tokens per decode step, over the jobs from the ``jobs_from``-th on (in ``order``)."""
    chosen = set((order or [])[jobs_from:]) if order is not None else None
    tok = steps = 0
    for b in batches:
        for job, n in b.tokens_per_job.items():
            if chosen is None or job in chosen:
                tok += n - 1
                steps += b.steps_per_job[job] - 1
    return tok / steps if steps else None


def pick(batches: list[Batch], method: str) -> Batch:
    """The batch ``method`` served in one round (rounds rotate the engines' order)."""
    return next(b for b in batches if b.method == method)


def by_method(rounds: list[list[Batch]]) -> dict[str, list[Batch]]:
    out: dict[str, list[Batch]] = {}
    for batches in rounds:
        for b in batches:
            out.setdefault(b.method, []).append(b)
    return out


def flips(rounds: list[list[Batch]]) -> dict[str, int]:
    """Per method, the jobs whose tokens differ from off's."""
    out = {}
    for batches in rounds:
        ref = next(b for b in batches if b.method == "off").outputs
        for b in batches:
            if b.method != "off":
                out[b.method] = out.get(b.method, 0) + sum(b.outputs[k] != ref[k] for k in ref)
    return out


def judged_outputs(rounds: list[list[Batch]], verdicts: list[dict[str, Any]], workload: str,
                   streams: str) -> dict[str, dict[str, int]]:
    """Per method: requests, identical, near-tie flips and unexplained differences in one cell
    (a difference the judge did not see counts as unexplained)."""
    requests = sum(len(b.outputs) for batches in rounds for b in batches if b.method == "off")
    return {method: spec_judge.tally(
                [v for v in verdicts if (v["workload"], v["streams"], v["method"])
                 == (workload, streams, method)], requests, differing)
            for method, differing in flips(rounds).items()}


def figures(results: dict[str, Any] | None) -> dict[str, Any] | None:
    """Per workload and stream count: tok/s, ratio to off, acceptance, tokens per step, output
    differences judged; the learning comparison; the threshold sweep; each target's verdict."""
    if not results:
        return None
    verdicts = results.get("judged") or []
    cells: dict[str, dict[str, Any]] = {}
    for workload, per_streams in results["grid"].items():
        cells[workload] = {}
        for streams, rounds in per_streams.items():
            m = by_method(rounds)
            off = rate(m["off"])
            cells[workload][streams] = {
                "rounds": len(rounds), "jobs": sum(len(b.tokens_per_job) for b in m["off"]),
                "tok_s": {k: rate(v) for k, v in m.items()},
                "ratio": {k: rate(v) / off for k, v in m.items() if k != "off"},
                "acceptance_rate": {k: acceptance(v) for k, v in m.items() if k != "off"},
                "tokens_per_step": {k: tokens_per_step(v) for k, v in m.items()},
                "outputs_differ": flips(rounds),
                "outputs": judged_outputs(rounds, verdicts, workload, streams)}
    threshold = [{**row, "outputs": threshold_outputs(row, verdicts),
                  **({"governed_outputs": threshold_outputs(row, verdicts, "governed")}
                     if "governed_ratio" in row else {})}
                 for row in results["threshold"]]
    return {"cells": cells, "learning": learning(results), "threshold": threshold,
            "disable_by_batch_size": results.get("disable_by_batch_size"),
            "governors": results.get("governors"),
            "suffix_stats": {k: v for k, v in (results.get("suffix_stats") or {}).items()
                             if k.startswith("spec_")},
            **judgement(cells, threshold, verdicts, results.get("tie_margin")),
            "targets": TARGETS, "met": verdicts_met(cells, learning(results))}


def threshold_outputs(row: dict[str, Any], verdicts: list[dict[str, Any]],
                      method: str = "ngram") -> dict[str, int]:
    """The threshold row's differences (``method``: ngram forced on, or governed, against
    off), judged."""
    where = (threshold_name(row.get("workload", "extraction")), str(row["streams"]), method)
    mine = [v for v in verdicts if (v["workload"], v["streams"], v["method"]) == where]
    requests = row["streams"] * row.get("rounds", 1)
    if f"{method}_differing" in row:
        differing = row[f"{method}_differing"]
    else:  # a row from before the governed engine: only forced-on ngram's count
        differing = row.get("differing", len(mine)) if method == "ngram" else len(mine)
    return spec_judge.tally(mine, requests, differing)


def judgement(cells: dict[str, Any], threshold: list[dict[str, Any]],
              verdicts: list[dict[str, Any]], margin: float | None) -> dict[str, Any]:
    """The run's totals: greedy requests compared with off, near-tie flips, and
    ``unexplained_differences`` (the count the issue's exactness promise needs at 0), with
    every judged difference listed."""
    tallies = [t for per in cells.values() for cell in per.values()
               for t in cell["outputs"].values()] + [row["outputs"] for row in threshold]
    tallies += [row["governed_outputs"] for row in threshold if "governed_outputs" in row]
    return {"compared_requests": sum(t["requests"] for t in tallies),
            "near_tie_flips": sum(t["near_tie_flips"] for t in tallies),
            "unexplained_differences": sum(t["unexplained"] for t in tallies),
            "tie_margin": margin, "tie_reference": spec_judge.REFERENCE,
            "differences": verdicts}


def learning(results: dict[str, Any]) -> dict[str, Any] | None:
    """Tokens per step of ngram and suffix on the extraction jobs from the 50th on (counting
    every extraction job the engines served, in order), over the jobs of the learning cell
    (``learning_streams``, the stream count whose extra rounds make the 50) only.

    Why that cell alone: jobs of other cells are served where speculation may not run at all
    (64 streams are past ``disable_by_batch_size``, 32: every step plain), so their tokens per
    step, ~1 for either engine, measure the cap and the governor, not the drafts; in the
    default grid they were 64 of the 82 jobs from the 50th on and hid the suffix engine's
    learning (1.07 against ngram's 1.2 tokens a step, where one stream alone gives 3.0 / 2.7).
    """
    per_streams = results["grid"].get("extraction") or {}
    cell = str(results.get("learning_streams", ""))
    order: list[str] = []
    batches: dict[str, list[Batch]] = {}
    for streams, rounds in per_streams.items():
        for round_ in rounds:
            for b in round_:
                if streams == cell or cell not in per_streams:
                    batches.setdefault(b.method, []).append(b)
            order += list(round_[0].tokens_per_job)
    if len(order) <= LEARNED_AFTER:
        return {"jobs": len(order), "note": f"fewer than {LEARNED_AFTER + 1} extraction jobs"}
    figures = {f"{m}_tokens_per_step": tokens_per_step(batches.get(m, []), LEARNED_AFTER, order)
               for m in ("ngram", "suffix")}
    if not any(figures.values()):
        return {"jobs": len(order), "note": f"no job of the {cell}-stream learning cell from the "
                f"{LEARNED_AFTER}th on: give it more rounds (spec_learning_rounds)"}
    return {"jobs": len(order), "from_job": LEARNED_AFTER, "streams": cell or None, **figures}


def verdicts_met(cells: dict[str, Any], learned: dict[str, Any] | None) -> dict[str, bool | None]:
    """Each target per method: 1 and 8 streams on extraction and edit, 64 streams everywhere,
    chat at every stream count, suffix >= ngram on extraction from the 50th job."""
    met: dict[str, bool | None] = {}
    for workload, per_streams in cells.items():
        for streams, cell in per_streams.items():
            bar = TARGETS["chat"] if workload == "chat" else TARGETS.get(streams)
            if bar is None:
                continue
            for method, ratio in cell["ratio"].items():
                met[f"{workload}_{streams}_{method}"] = ratio >= bar
    if learned and "suffix_tokens_per_step" in learned:
        met["suffix_ge_ngram_from_job_50"] = (learned["suffix_tokens_per_step"] or 0) >= (
            learned["ngram_tokens_per_step"] or 0)
    return met


def _outputs(t: dict[str, int] | None) -> str:
    if not t:
        return "-"
    return f"{t['identical']} / {t['near_tie_flips']} / {t['unexplained']}"


def judgement_line(figs: dict[str, Any]) -> str:
    """The exactness verdict: loud when any greedy output differs from off's unexplained."""
    n, flips = figs.get("compared_requests", 0), figs.get("near_tie_flips", 0)
    bad = figs.get("unexplained_differences", 0)
    margin = f"{figs['tie_margin']:g}" if figs.get("tie_margin") is not None else "?"
    head = (f"Outputs against off: {n} greedy requests compared, {flips} near-tie flips "
            f"(both candidate tokens within {margin} logits in the packed model and its fp32 "
            f"twin)")
    if not bad:
        return head + ", **0 unexplained differences**."
    where = "; ".join(f"{v['workload']} {v['streams']} streams {v['method']} job {v['job']} "
                      f"at token {v['position']}: {v['why']}"
                      for v in figs.get("differences", []) if not v["near_tie"])
    return (head + f". **UNEXPLAINED DIFFERENCES: {bad}** (speculation changed a greedy output "
            f"beyond a near-tie: a bug until explained): {where or 'not judged'}.")


def _f(v: Any, digits: int = 3) -> str:
    return "-" if v is None else (f"{v:.{digits}g}" if isinstance(v, float) else str(v))


def threshold_markdown(rows: list[dict[str, Any]], governors: dict[str, Any] | None) -> str:
    """The threshold sweep's table: per workload and stream count, off, ngram forced on and
    (when run) ngram under the governor, then the buckets the governor speculates in."""
    lines = ["| workload | streams | tok/s off | forced-on ngram (x off) | ratio per round | "
             "governed ngram (x off) | ratio per round | acceptance forced / governed | "
             "tokens/step forced / governed | outputs vs off, forced; governed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        governed = "governed_ratio" in r
        lines.append(
            f"| {r.get('workload', 'extraction')} | {r['streams']} | {_f(r['off_tok_s'])} | "
            f"{_f(r['ngram_tok_s'])} ({_f(r['ratio'])}x) | "
            f"{', '.join(_f(x) for x in r.get('round_ratios', []))} | "
            + (f"{_f(r['governed_tok_s'])} ({_f(r['governed_ratio'])}x) | "
               f"{', '.join(_f(x) for x in r['governed_round_ratios'])} | " if governed
               else "- | - | ")
            + f"{_f(r['acceptance_rate'], 2)} / {_f(r.get('governed_acceptance_rate'), 2)} | "
            f"{_f(r.get('tokens_per_step'))} / {_f(r.get('governed_tokens_per_step'))} | "
            f"{_outputs(r.get('outputs'))}; {_outputs(r.get('governed_outputs'))} |")
    state = (governors or {}).get("threshold_governed")
    if state:
        buckets = "; ".join(
            f"{name}: {'spec' if b['speculate'] else 'plain' if b['speculate'] is False else '?'}"
            f" ({_f(b['seq_tok_s_spec'])} / {_f(b['seq_tok_s_plain'])})"
            for name, b in state["buckets"].items())
        lines += ["", f"Governor after the sweep (running sequences: choice, measured tok/s "
                  f"per sequence with / without drafts): {buckets or 'no bucket measured'}."]
    return "\n".join(lines)


def markdown(figs: dict[str, Any] | None) -> str:
    """docs' table: per workload and streams, tok/s off / ngram / suffix, ratios, acceptance,
    tokens per step, target and verdicts."""
    if not figs:
        return ""
    lines = ["| workload | streams | tok/s off | ngram (x off) | suffix (x off) | acceptance "
             "ngram / suffix | tokens/step off / ngram / suffix | target | outputs vs off: identical "
             "/ near-tie flips / unexplained, ngram; suffix |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, per_streams in figs["cells"].items():
        for streams, cell in per_streams.items():
            tok, ratio, acc, tps = (cell["tok_s"], cell["ratio"], cell["acceptance_rate"],
                                    cell["tokens_per_step"])
            bar = TARGETS["chat"] if workload == "chat" else TARGETS.get(streams)
            lines.append(
                f"| {workload} | {streams} | {_f(tok['off'])} | {_f(tok['ngram'])} "
                f"({_f(ratio['ngram'])}x) | {_f(tok['suffix'])} ({_f(ratio['suffix'])}x) | "
                f"{_f(acc['ngram'], 2)} / {_f(acc['suffix'], 2)} | "
                + " / ".join(_f(tps[m], 3) for m in METHODS)
                + f" | {'>= ' + str(bar) + 'x' if bar else '-'} | "
                + "; ".join(_outputs(cell["outputs"].get(m)) for m in METHODS[1:])
                + f" (of {cell['jobs']}) |")
    learned = figs.get("learning") or {}
    if "suffix_tokens_per_step" in learned:
        cell = f" of the {learned['streams']}-stream cell" if learned.get("streams") else ""
        lines += ["", f"Extraction jobs{cell} from the {learned['from_job']}th (after the "
                  f"suffix engine saw {learned['from_job']}): tokens per decode step ngram "
                  f"{_f(learned['ngram_tokens_per_step'])}, suffix "
                  f"{_f(learned['suffix_tokens_per_step'])}."]
    if figs.get("threshold"):
        lines += ["", threshold_markdown(figs["threshold"], figs.get("governors"))]
    lines += ["", judgement_line(figs)]
    met = figs.get("met") or {}
    lines += ["", "Targets: " + "; ".join(
        f"{k} {'met' if v else 'NOT met'}" for k, v in met.items() if v is not None) + "."]
    return "\n".join(lines) + "\n"
