"""What every chaos scenario uses: a workload of exactly checkable jobs, a fleet of worker
processes to kill, and an audit that counts jobs lost, duplicated and mismatched.

The oracle for tokens is the in-process engine; the oracle for "ended exactly once" is the raw
output stream in Redis (one terminal event, seq 1..N without a gap, each sample's positions
contiguous) together with what the client's handle returned. A job whose tokens differ from
the engine's is a near-tie flip only when transformers says so (``near_tie``: every token of
the stream is transformers' own choice or within rounding of it, and at the first difference
both tokens are), and flips are bounded (``Audit.max_flips``).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from pagedq.client import Client, SamplingParams
from pagedq.client.protocol import TERMINAL, TOKENS, Keys, decode_event

ENGINE = dict(num_kv_blocks=256, max_num_seqs=8, max_model_len=256)
ENGINE_ARGS = ["--num-kv-blocks", "256", "--max-num-seqs", "8", "--max-model-len", "256"]


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    id: str = ""
    result: object = None  # the client's Result, or the exception it raised


def workload(count: int, seed: int = 0, max_tokens: tuple[int, int] = (8, 48),
             shuffle_seed: int | None = None) -> list[Job]:
    """Greedy, seeded and n=2 seeded jobs in turn, with random prompts and lengths.

    ``shuffle_seed``: the jobs in a shuffled order instead. Jobs reach idle workers in turn, so
    with three workers the greedy/seeded/n=2 cycle would hand every n=2 job (twice the tokens)
    to one of them; tests that measure how the work spreads shuffle it."""
    rng = random.Random(seed)
    jobs = []
    for k in range(count):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(2, 12))]
        length = rng.randrange(*max_tokens)
        kind = k % 3
        params = (SamplingParams(temperature=0, max_tokens=length, ignore_eos=True) if kind == 0
                  else SamplingParams(temperature=0.9, seed=rng.randrange(1 << 30),
                                      max_tokens=length, ignore_eos=True) if kind == 1
                  else SamplingParams(n=2, temperature=1.0, seed=rng.randrange(1 << 30),
                                      max_tokens=length, ignore_eos=True))
        jobs.append(Job(prompt, params))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(jobs)
    return jobs


def expected_tokens(model: str, jobs: list[Job]) -> list[list[list[int]]]:
    """Each job's tokens per sample, from the in-process engine (batched: fast)."""
    from pagedq.worker import Engine

    engine = Engine(model, **ENGINE)
    outs = engine.generate([j.prompt for j in jobs], [j.params for j in jobs])
    return [[o.token_ids for o in out.outputs] for out in outs]


@dataclass
class Audit:
    """What happened to each job, counted the way docs/operations.md reports it."""

    total: int = 0
    done: int = 0  # ended exactly once, tokens equal to the engine's, seamless stream
    lost: int = 0  # no terminal event
    duplicated: int = 0  # more than one terminal event, or a seq/position repeated
    mismatched: int = 0  # tokens differ from the engine's (client's view or the stream's)
    failed: int = 0  # ended by an error event (or the client raised)
    # ended exactly once with a seamless stream whose tokens differ from the reference run's
    # at one near-tie only (see near_tie): fp32 logits round differently in another batch
    flipped: int = 0
    tokens: int = 0  # tokens the jobs generate in all (the reference's)
    problems: list[str] = field(default_factory=list)

    @property
    def max_flips(self) -> int:
        """The most near-tie flips a shuffled load may show: the long spread run saw 21 in 600
        jobs (~100,000 tokens, one per ~5,000 on the tiny model's flat logits); allowed is 2.5
        times that rate, plus 3 so a short run's chance clusters do not fail it."""
        return 3 + self.tokens // 2000

    @property
    def clean(self) -> bool:
        """Every job ended exactly once with the engine's tokens; near-tie flips are allowed
        at 1% of jobs, and one in any run: a short fault run's ~1,000 tokens meet a flip by
        chance now and then (one per ~5,000 tokens on the tiny model's flat logits, see
        ``max_flips``), and each flip is still one transformers calls a near-tie."""
        return (self.done + self.flipped == self.total
                and self.flipped <= max(1, self.total // 100))

    @property
    def explained(self) -> bool:
        """Every job ended exactly once with the engine's tokens or a near-tie transformers
        explains, at most ``max_flips`` of them (shuffled loads mix batches more than the fault
        scenarios do)."""
        return self.done + self.flipped == self.total and self.flipped <= self.max_flips

    def __str__(self) -> str:
        return (f"{self.total} jobs: {self.done} exact, {self.flipped} near-tie flips "
                f"(at most {self.max_flips}), "
                f"{self.lost} lost, {self.duplicated} duplicated, {self.mismatched} mismatched, "
                f"{self.failed} failed")


def audit(r, keys: Keys, jobs: list[Job], expected: list[list[list[int]]],
          streams: bool = True, model: str | None = None) -> Audit:
    """Count each job's fate. ``streams=False`` judges by what the clients got alone (a Redis
    that kept nothing across a restart has no streams left to read). With ``model``, a
    mismatch that ``near_tie`` explains counts as a flip."""
    out = Audit(total=len(jobs), tokens=sum(len(t) for w in expected for t in w))
    for job, want in zip(jobs, expected, strict=True):
        evs = [decode_event(f, i) for i, f in r.xrange(keys.out(job.id))] if streams else None
        verdict = _verdict(job, evs, want) if streams else _client_verdict(job, want)
        why = ""
        if verdict == "mismatched" and model is not None and not isinstance(job.result,
                                                                             Exception):
            got = [o.token_ids for o in job.result.outputs]
            if evs is None or [_stream_tokens(evs, k) for k in range(len(want))] == got:
                why = near_tie(model, job, got, want)  # the stream and the client agree
            verdict = "flipped" if why else verdict
        setattr(out, verdict, getattr(out, verdict) + 1)
        if verdict != "done":
            out.problems.append(f"{job.id}: {verdict} {why} ({job.result!r})"[:400])
    return out


# How far from transformers' own choice a token may be and still be a near-tie: fp32 logits
# of one request round differently in another batch, and only a choice that close can flip.
TIE_LOGIT = 1e-3  # greedy: logit gap below transformers' argmax (tests/oracle.py's TIE)
TIE_CDF = 1e-4  # sampled: distance of the seeded draw from the token's CDF interval (of 1)


def near_tie(model: str, job: Job, got: list[list[int]], want: list[list[int]]) -> str:
    """Why ``got`` (the stream) differs from the reference ``want``, when transformers calls
    it a near-tie, else "". Teacher-forcing each sample's stream through transformers' forward,
    every token must be the sampler's choice on transformers' logits (argmax, or the seeded
    draw's inverse-CDF pick) or within TIE_LOGIT / TIE_CDF of it, and at the first position
    where the stream and the reference differ, both tokens must be. A protocol fault (a token
    lost, repeated, or continued from the wrong prefix) puts a far token in the stream."""
    if [len(g) for g in got] != [len(w) for w in want]:
        return ""
    cuts = []
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        slack = _slack_fn(model, job, index, g)
        if any(not _near(job, slack(i, t)) for i, t in enumerate(g)):
            return ""
        cut = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(g))
        if cut < len(g) and not _near(job, slack(cut, w[cut])):
            return ""
        cuts.append(cut)
    return f"(transformers: near-tie at positions {cuts})"


def _near(job: Job, slack: float) -> bool:
    return slack < (TIE_LOGIT if job.params.greedy else TIE_CDF)


def _slack_fn(model: str, job: Job, index: int, tokens: list[int]):
    """slack(position, token): 0 when ``token`` is what the engine's sampler picks at that
    position from transformers' logits (the stream's tokens before it as the context), else
    how far it misses: a logit gap (greedy) or the seeded draw's distance from the token's
    CDF interval (sampled; pagedq.worker.engine.sampler's inverse CDF, same uniform)."""
    import torch

    from pagedq.worker.engine.sampler import seeded_uniform
    from tests.oracle import hf_logits

    p = job.params
    assert (p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty), "near_tie judges plain greedy or seeded draws only"
    start = len(job.prompt) - 1
    rows = hf_logits(model, job.prompt + tokens)[start:start + len(tokens)].double()

    def slack(pos: int, token: int) -> float:
        row = rows[pos]
        if p.greedy:
            return float(row.max() - row[token])
        cdf = torch.softmax(row / p.temperature, dim=-1).cumsum(-1)
        target = seeded_uniform(p.seed, index, pos) * float(cdf[-1])
        low, high = (float(cdf[token - 1]) if token else 0.0), float(cdf[token])
        return max(0.0, low - target, target - high) / float(cdf[-1])

    return slack


def _stream_tokens(evs: list, index: int) -> list[int]:
    return [t for e in evs if e.type == TOKENS and e.index == index for t in e.token_ids]


def _client_verdict(job: Job, want: list[list[int]]) -> str:
    if job.result is None or isinstance(job.result, TimeoutError):
        return "lost"
    if isinstance(job.result, Exception):
        return "failed"
    return "done" if [o.token_ids for o in job.result.outputs] == want else "mismatched"


def _verdict(job: Job, evs: list, want: list[list[int]]) -> str:
    terminals = [e for e in evs if e.type in TERMINAL]
    if not terminals:
        return "lost"
    if len(terminals) > 1 or [e.seq for e in evs] != list(range(1, len(evs) + 1)):
        return "duplicated"
    if terminals[0].type != "finished" or isinstance(job.result, Exception):
        return "failed"
    for index, tokens in enumerate(want):
        pos, got = 0, []
        for e in evs:
            if e.type == TOKENS and e.index == index:
                if e.position - len(e.token_ids) != pos:
                    return "duplicated"
                pos = e.position
                got += e.token_ids
        client = job.result.outputs[index].token_ids if job.result is not None else None
        if got != tokens or client != tokens:
            return "mismatched"
    return "done"


class Submitter:
    """Submits jobs from a thread and waits for each result on a pool of threads, as a
    backend would, so faults hit clients mid-read too."""

    def __init__(self, url: str, queue: str, jobs: list[Job], rate: float = 0.0,
                 timeout: float = 600):
        self.url, self.queue, self.jobs = url, queue, jobs
        self.rate, self.timeout = rate, timeout
        self.refused: list[Exception] = []  # submits Redis refused (OOM...)
        self.threads: list[threading.Thread] = []

    def start(self) -> Submitter:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        self.threads.append(thread)
        return self

    def _run(self) -> None:
        client = Client(self.url, self.queue)
        waiters = []
        for job in self.jobs:
            handle = None
            for _attempt in range(120):
                try:
                    handle = client.submit(job.prompt, job.params)
                    break
                except Exception as exc:  # Redis refused it: retried, as a backend would
                    self.refused.append(exc)
                    time.sleep(0.5)
            if handle is None:
                job.result = self.refused[-1]
                continue
            job.id = handle.id
            t = threading.Thread(target=self._wait, args=(handle, job), daemon=True)
            t.start()
            waiters.append(t)
            if self.rate:
                time.sleep(1 / self.rate)
        for t in waiters:
            t.join()

    def _wait(self, handle, job: Job) -> None:
        try:
            job.result = handle.result(timeout=self.timeout)
        except Exception as exc:  # counted by the audit
            job.result = exc

    def join(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, end - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)


class Fleet:
    """Worker processes (``python -m pagedq.worker``) under stable consumer names."""

    def __init__(self, url: str, model: str, queue: str, log_dir: Path, *extra: str):
        self.url, self.model, self.queue, self.log_dir = url, model, queue, log_dir
        self.extra = list(extra)
        self.procs: dict[str, subprocess.Popen] = {}
        self.kills = 0
        self.starts = 0

    def spawn(self, name: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{self.queue}-{name}.log", "ab")
        cmd = [sys.executable, "-m", "pagedq.worker", "--model", self.model, "--redis-url",
               self.url, "--queue", self.queue, "--consumer-name", name, "--log-format", "json",
               *ENGINE_ARGS, *self.extra]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        return self.procs[name]

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            self.kills += 1

    def rss(self, name: str) -> int:
        try:
            return psutil.Process(self.procs[name].pid).memory_info().rss
        except psutil.Error:
            return 0

    def crashed(self) -> dict[str, int]:
        """Workers that exited on their own (not killed here), with their exit codes."""
        return {n: p.returncode for n, p in self.procs.items()
                if p.poll() is not None and p.returncode != -signal.SIGKILL}

    def stop(self) -> dict[str, int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes


def wait_serving(r, keys: Keys, names: list[str], timeout: float = 180,
                 fleet: Fleet | None = None) -> None:
    """Until each named worker's checkpoint exists (written by the process ``fleet`` runs
    under that name now, when given)."""
    def serving(name: str) -> bool:
        pid = r.hget(keys.worker(name), "pid")
        return pid is not None and (fleet is None or int(pid) == fleet.procs[name].pid)

    end = time.monotonic() + timeout
    while not all(serving(n) for n in names):
        assert time.monotonic() < end, "workers did not start"
        time.sleep(0.1)


def tokens_per_worker(r, keys: Keys, jobs: list[Job], names: list[str]) -> dict[str, int]:
    """Generated tokens each worker published (each job's token events name their writer)."""
    counts = dict.fromkeys(names, 0)
    for job in jobs:
        for entry_id, fields in r.xrange(keys.out(job.id)):
            ev = decode_event(fields, entry_id)
            if ev.type == TOKENS and ev.worker:
                counts[ev.worker] = counts.get(ev.worker, 0) + len(ev.token_ids)
    return counts


def spread(counts: dict[str, int]) -> float:
    """(max - min) / mean of the per-worker counts: 0 is a perfectly even share."""
    mean = sum(counts.values()) / len(counts)
    return (max(counts.values()) - min(counts.values())) / mean if mean else 0.0


def report(name: str, **figures) -> None:
    """Print a scenario's figures (``pytest -s`` shows them; docs/operations.md quotes them)."""
    print(f"\nCHAOS {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
