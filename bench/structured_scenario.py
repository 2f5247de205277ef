"""The ``structured`` scenario: what a JSON schema costs a full batch.

N extraction requests (chat prompts asking for a person's fields from a short record) run with
a JSON schema, then the same requests run unconstrained with the same seeds and exactly the
same output lengths (``max_tokens`` = each constrained output's length, ``ignore_eos``), so both
runs do the same model work and the ratio of their token throughputs is the constraint's cost.
The two runs alternate twice (constrained, free, constrained, free) so a drift of the machine's
speed cancels to first order, on an engine that has compiled the schema first (a warm worker:
what a cold one adds is the TTFT figures below). Also measured: the engine's mask time per
constrained step, and the TTFT of one constrained request on a fresh engine (xgrammar loaded
and the tokenizer's table built), with a schema new to a warm engine (a compile) and with a
cached schema.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from pagedq.bench import driver
from pagedq.bench.context import BenchContext, Unavailable
from pagedq.bench.timeline import summarize
from pagedq.bench.workload import BenchRequest
from pagedq.params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"anyOf": [{"type": "string", "pattern": "^[a-z.]{1,20}@[a-z]{1,12}\\.[a-z]{2,3}$"},
                            {"type": "null"}]},
        "role": {"enum": ["engineer", "manager", "designer", "analyst", "other"]},
        "city": {"type": "string", "maxLength": 30},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                   "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "email", "role", "city", "skills"],
}
FIRST = ["Alice", "Bruno", "Chen", "Dara", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jules"]
LAST = ["Moreau", "Silva", "Li", "Okafor", "Haddad", "Novak", "Sato", "Berg", "Costa", "Reyes"]
CITIES = ["Lyon", "Porto", "Osaka", "Lagos", "Beirut", "Zagreb", "Oslo", "Quito", "Leeds"]
ROLES = ["engineer", "manager", "designer", "analyst"]
SKILLS = ["python", "sql", "design", "sales", "rust", "statistics", "writing", "cloud"]


@dataclass(frozen=True)
class SampledRequest(BenchRequest):
    """A trace request with its own sampling params (a constraint, a seed)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)

    def params(self) -> SamplingParams:
        return self.sampling


def record(rng: random.Random) -> str:
    """A short free-text record of one person, the extraction's input."""
    first, last = rng.choice(FIRST), rng.choice(LAST)
    email = f"{first.lower()}.{last.lower()}@example.com" if rng.random() < 0.7 else "none"
    skills = ", ".join(rng.sample(SKILLS, rng.randint(1, 3)))
    return (f"{first} {last} is {rng.randint(22, 65)} and works as a {rng.choice(ROLES)} in "
            f"{rng.choice(CITIES)}. Email: {email}. Skills: {skills}.")


def prompts(engine: Any, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [engine.apply_chat_template([{"role": "user", "content": (
        "Extract the person's name, age, email (null if none), role, city and skills as JSON.\n"
        + record(rng))}]) for _ in range(n)]


def structured(bench: BenchContext) -> None:
    """The scenario (``bench.results["structured"]``); unavailable for a model without a
    tokenizer, which no grammar can be built on."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.models.loader import load_tokenizer

    if load_tokenizer(bench.model_dir) is None:
        raise Unavailable("structured outputs need the model's tokenizer; this model has none")
    bench.results["structured"] = run_structured(bench)


def run_structured(run: BenchContext) -> dict[str, Any]:
    c = run.config
    ttft = cold_and_cached_ttft(run)
    engine = run.engine(max_num_seqs=max(c.max_num_seqs, c.structured_requests),
                        num_kv_blocks=c.structured_requests * run.blocks_for(512) + 16)
    ids = prompts(engine, c.structured_requests, c.seed)
    constrained = [SampledRequest(f"so-{i}", p, c.structured_max_tokens, SamplingParams(
        temperature=c.structured_temperature, seed=c.seed + i, max_tokens=c.structured_max_tokens,
        structured_outputs={"json": SCHEMA})) for i, p in enumerate(ids)]
    # the timed runs measure a warm worker: its grammar process started and the schema
    # compiled (one request first); what a cold one adds is cold_and_cached_ttft's figures.
    # Without it the first constrained run waited ~3 s for both (a fresh engine's compile
    # process: Zen 5, 16 requests), a third of its time, and the ratio read 0.64 for 0.94.
    driver.serve(engine, [SampledRequest("so-warm", ids[0], 1, SamplingParams(
        temperature=0.0, max_tokens=1, structured_outputs={"json": SCHEMA}))], record_kv=False)
    engine.reset_prefix_cache()
    runs: dict[str, list[driver.EngineRun]] = {"constrained": [], "free": []}
    free: list[SampledRequest] = []
    for _ in range(2):
        mask0, steps0 = engine.structured.mask_seconds, engine.structured.mask_steps
        done = driver.serve(engine, constrained, record_kv=False, keep_outputs=True)
        done.stats_after["mask_s"] = engine.structured.mask_seconds - mask0
        done.stats_after["mask_steps"] = engine.structured.mask_steps - steps0
        runs["constrained"].append(done)
        if not free:  # the same seeds and exactly the constrained outputs' lengths
            free = [SampledRequest(f"free-{r.request_id}", r.prompt_token_ids,
                                   len(done.outputs[r.request_id]), SamplingParams(
                                       temperature=c.structured_temperature, seed=r.sampling.seed,
                                       max_tokens=len(done.outputs[r.request_id]), ignore_eos=True))
                    for r in constrained]
        engine.reset_prefix_cache()
        runs["free"].append(driver.serve(engine, free, record_kv=False))
        engine.reset_prefix_cache()
    texts = [engine.tokenizer.decode(runs["constrained"][0].outputs[r.request_id],
                                     skip_special_tokens=True) for r in constrained]
    return {"runs": runs, "ttft": ttft, "texts": texts, "requests": c.structured_requests}


def cold_and_cached_ttft(run: BenchContext) -> dict[str, float]:
    """TTFT of one constrained request (one output token): on a fresh engine, with a schema the
    warm engine has not seen (compile only), and with that schema again (cached)."""
    engine = run.engine(max_num_seqs=4, num_kv_blocks=run.blocks_for(2048) + 8)
    (prompt,) = prompts(engine, 1, run.config.seed + 99)
    variant = {**SCHEMA, "properties": {**SCHEMA["properties"], "note": {"type": "boolean"}}}
    out: dict[str, float] = {}
    for label, schema in (("fresh_engine_s", SCHEMA), ("new_schema_s", variant),
                          ("cached_schema_s", variant)):
        req = SampledRequest(f"ttft-{label}", prompt, 1, SamplingParams(
            temperature=0.0, max_tokens=1, structured_outputs={"json": schema}))
        engine.reset_prefix_cache()  # the same prompt each time: its prefill is not cached
        out[label] = driver.serve(engine, [req], record_kv=False).timeline.requests[
            req.request_id].ttft
    return out


def figures(res: dict[str, Any], out: dict[str, Any]) -> None:
    """The report's ``structured_throughput_ratio`` and its details."""
    # the engine side is lazy in bench/: see context.py's setup
    import jsonschema

    s = res["structured"]
    rate = {k: [r.timeline.tokens_per_s for r in v] for k, v in s["runs"].items()}
    steps = sum(r.stats_after["mask_steps"] for r in s["runs"]["constrained"])
    mask_s = sum(r.stats_after["mask_s"] for r in s["runs"]["constrained"])
    step_s = sum(r.timeline.elapsed for r in s["runs"]["constrained"]) / max(
        1, sum(r.steps for r in s["runs"]["constrained"]))
    valid = 0
    for text in s["texts"]:
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    out["structured_throughput_ratio"] = sum(rate["constrained"]) / sum(rate["free"])
    out["tokens_per_s"]["structured_json"] = sum(rate["constrained"]) / 2
    out["tokens_per_s"]["structured_free_same_lengths"] = sum(rate["free"]) / 2
    first = s["runs"]["constrained"][0]
    out["details"]["structured"] = {
        "requests": s["requests"], "tok_s_constrained": rate["constrained"],
        "tok_s_free": rate["free"], "valid_outputs": valid,
        "mean_output_tokens": sum(map(len, first.outputs.values())) / len(first.outputs),
        "mask_ms_per_step": 1e3 * mask_s / max(1, steps),
        "mask_share_of_step": (mask_s / max(1, steps)) / step_s if step_s else None,
        "ttft_s": s["ttft"], "ttft_constrained_run_s": summarize(first.timeline.ttfts()),
        "example": s["texts"][0] if s["texts"] else None,
    }
