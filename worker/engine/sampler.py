"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, greedy, seeded draws.

All rows are processed together on tensors; per-row parameters become columns. A sampled token
is drawn by inverse CDF from one uniform number per row. For a seeded request that number is a
pure function of (seed, sample index, position), so its tokens never depend on its batch mates
and a job resumed on another worker continues exactly where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedq.worker.engine.sequence import Sequence

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A fast, well-mixed 64-bit hash (Steele et al.); the seeded draws' only randomness."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int, position: int) -> float:
    """Uniform in [0, 1) determined by the request seed, the sample index and the position."""
    x = splitmix64(splitmix64(splitmix64(seed) ^ index) ^ position)
    return (x >> 11) * (1.0 / (1 << 53))


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each chosen token (raw model distribution)
    top_logprobs: list[dict[int, float] | None] | None


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place."""
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0
            or s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
    if not rows:
        return
    vocab = logits.shape[1]
    sub = [seqs[i] for i in rows]
    idx = torch.tensor(rows, device=logits.device)
    x = logits[idx]
    out_counts = _counts([s.output_token_ids for s in sub], vocab, logits.device)
    seen = out_counts > 0
    seen |= _counts([s.token_ids[:s.num_prompt_tokens] for s in sub], vocab, logits.device) > 0

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in sub], dtype=x.dtype,
                            device=x.device)[:, None]

    rep = column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x -= column("frequency_penalty") * out_counts + column("presence_penalty") * (out_counts > 0)
    logits[idx] = x


def _counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab] occurrence counts, built with one scatter_add."""
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for r, toks in enumerate(token_lists):
        if toks:
            ids[r, :len(toks)] = torch.tensor(toks)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias: each row's biases added to its logits in one scatter, in place."""
    rows, cols, vals = [], [], []
    for i, s in enumerate(seqs):
        for token, bias in (s.params.logit_bias or {}).items():
            if token < logits.shape[1]:
                rows.append(i)
                cols.append(token)
                vals.append(bias)
    if rows:
        logits.index_put_((torch.tensor(rows, device=logits.device),
                           torch.tensor(cols, device=logits.device)),
                          torch.tensor(vals, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


def min_tokens_pending(seq: Sequence) -> bool:
    """Whether ``seq`` is still short of its ``min_tokens`` (mask_min_tokens acts on it)."""
    return bool(seq.params.min_tokens) and seq.num_generated < seq.params.min_tokens


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> bool:
    """Forbid EOS and stop tokens until a sequence has its ``min_tokens``, unless they are all
    that is left (a complete structured output may only end): the row keeps them then.
    Returns whether any row was masked."""
    masked = False
    for i, s in enumerate(seqs):
        p = s.params
        if min_tokens_pending(s):
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(s.request.eos_token_ids))
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                kept = logits[i, banned].clone()
                logits[i, banned] = float("-inf")
                masked = True
                if s.params.structured_outputs is not None and not bool(logits[i].isfinite().any()):
                    logits[i, banned] = kept
    return masked


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p (on the top-k renormalised) and min-p.

    Always in vocabulary order, and each row is filtered on its own (only rows with top-k or
    top-p are sorted): a row's draw never depends on what its batch mates asked for. Rows need
    not be renormalised.
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    vocab = probs.shape[1]
    rows = ((top_p < 1.0) | ((top_k > 0) & (top_k < vocab))).nonzero().flatten()
    if rows.numel():
        sub, order = probs[rows].sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)[None, :]
        k = torch.where(top_k[rows] > 0, top_k[rows], vocab)[:, None]
        sub = sub.masked_fill(rank >= k, 0.0)
        sub = sub / sub.sum(-1, keepdim=True)
        before = sub.cumsum(-1) - sub  # mass strictly before each token
        keep = (rank < k) & (before <= top_p[rows][:, None])
        probs[rows] = probs[rows] * torch.zeros_like(keep).scatter_(1, order, keep)
    if bool((min_p > 0).any()):
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < min_p[:, None] * top, 0.0)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column index per row with P(col) proportional to probs[row, col]; u uniform in [0, 1)."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[1] - 1)


Argmax = Callable[[torch.Tensor], torch.Tensor]  # [rows, vocab] fp32 -> int64 [rows]


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest value's index (max's index: 1.6x faster than argmax on CPU)."""
    return logits.max(dim=-1).indices


def greedy_argmax(ops: Any) -> Argmax:
    """The C++ ``argmax_rows`` where the CPU library is loaded (``ops``: the engine's
    ``Backend.ops``; None elsewhere): 0.72 -> 0.08 ms over 64 rows of 49152 logits, 0.025
    -> 0.004 over one (AMD EPYC Zen 5, 2 threads), the same index as torch's max (the first
    maximum, the first NaN). Logits it does not take (not CPU fp32 rows) go to torch."""
    if ops is None:
        return torch_argmax

    def cpp(logits: torch.Tensor) -> torch.Tensor:
        if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
                or logits.shape[1] == 0 or logits.stride(1) != 1):
            return torch_argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        ops.argmax_rows(out, logits)
        return out
    return cpp


# constrain(logits, seqs, best): mask rows in place; ``best`` holds each row's greedy pick
# before any mask (-1 where the row must be masked whatever it is; None: every row is masked);
# returns whether it masked
Constrain = Callable[[torch.Tensor, list[Sequence], list[int] | None], bool]


class Sampler:
    """``constrain(logits, seqs, best)`` masks rows in place after the penalties (structured
    outputs); logprobs are the model's own distribution, taken before penalties and masks;
    ``argmax`` picks the greedy rows' tokens (greedy_argmax).

    A greedy row needs its grammar's mask only when its best token is one the grammar refuses:
    the best allowed token is the best token whenever that one is allowed (ties included: a
    token with the same logit at a lower index would have been the best). So ``constrain`` is
    given each greedy row's pick before any mask, and masks only rows whose pick it refuses
    (StructuredOutputs.apply), and the pick stands when nothing was masked. Rows still short
    of ``min_tokens`` are masked as before: their stop tokens come off after the grammar's."""

    def __init__(self, seed: int = 0, constrain: Constrain | None = None,
                 argmax: Argmax = torch_argmax) -> None:
        self.generator = torch.Generator().manual_seed(seed)  # for unseeded requests
        self.constrain = constrain
        self.argmax = argmax

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """One token per row of ``logits`` [rows, vocab] (fp32); row i belongs to seqs[i]."""
        want_lp = any(s.params.logprobs is not None for s in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
        apply_penalties(logits, seqs)
        apply_logit_bias(logits, seqs)
        tokens: torch.Tensor | None = None
        if self.constrain is not None:
            best = None  # greedy picks, only where a greedy row may be constrained
            if any(s.params.greedy and s.params.structured_outputs is not None for s in seqs):
                tokens = self.argmax(logits)
                best = [t if s.params.greedy and not min_tokens_pending(s) else -1
                        for t, s in zip(tokens.tolist(), seqs, strict=True)]
            if self.constrain(logits, seqs, best):
                tokens = None
        if mask_min_tokens(logits, seqs) or tokens is None:
            tokens = self.argmax(logits)
        rand_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rand_rows:
            tokens[rand_rows] = self._sample_rows(logits[rand_rows], [seqs[i] for i in rand_rows])
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(token_list, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        tops: list[dict[int, float] | None] = []
        for i, s in enumerate(seqs):
            k = s.params.logprobs
            if k is None:
                tops.append(None)
                continue
            top = {}
            if k:
                vals, ids = raw_logprobs[i].topk(k)
                top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
            top[token_list[i]] = chosen[i]
            tops.append(top)
        return SampleResult(token_list, chosen, tops)

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        u = torch.rand(len(seqs), generator=self.generator, dtype=torch.float64)
        for r, s in enumerate(seqs):
            if s.params.seed is not None:
                u[r] = seeded_uniform(s.params.seed, s.index, s.num_generated)
        narrow = narrow_rows(logits, seqs)
        if narrow is None:
            return draw(logits, seqs, u)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        taken = set(narrow.rows)
        wide = [r for r in range(len(seqs)) if r not in taken]
        if wide:
            tokens[wide] = draw(logits[wide], [seqs[r] for r in wide], u[wide])
        picks = draw(narrow.logits, [seqs[r] for r in narrow.rows], u[narrow.rows])
        tokens[narrow.rows] = narrow.columns.gather(1, picks[:, None]).squeeze(1)
        return tokens


# A constrained row whose grammar allows at most this many tokens is drawn over those alone.
NARROW = 1024


@dataclass
class NarrowRows:
    """The rows drawn over their allowed tokens alone, those tokens' logits in vocabulary
    order (-inf after a row's last: [rows, widest]) and their columns."""

    rows: list[int]
    logits: torch.Tensor
    columns: torch.Tensor


def narrow_rows(logits: torch.Tensor, seqs: list[Sequence]) -> NarrowRows | None:
    """Structured rows whose mask leaves 1..NARROW tokens (a key, a number, an enum: 97% of a
    tool call's rows, a quarter of them forced), compacted; None when there are none.

    Why: a draw over the whole vocabulary (softmax, cumsum, search over 49,152 columns) costs
    the same for a row with one allowed token as for a free one. Over the allowed tokens alone,
    in vocabulary order, the inverse CDF walks the same tokens in the same order (the masked
    ones have probability 0), so the token is the one the whole row gives."""
    structured = [r for r, s in enumerate(seqs) if s.params.structured_outputs is not None]
    if not structured:
        return None
    # only the structured rows are scanned (all of them in a tool call: no copy then)
    sub = logits if len(structured) == len(seqs) else logits[structured]
    allowed = sub > float("-inf")
    counts = allowed.sum(-1)
    keep = [i for i, c in enumerate(counts.tolist()) if 0 < c <= NARROW]
    if not keep:
        return None
    index = torch.tensor(keep, device=logits.device)
    kept = counts[index]
    local, columns = allowed[index].nonzero(as_tuple=True)  # row-major: vocabulary order
    place = torch.arange(len(columns), device=logits.device) - (kept.cumsum(0) - kept)[local]
    width = int(kept.max())
    values = torch.full((len(keep), width), float("-inf"), dtype=logits.dtype,
                        device=logits.device)
    values[local, place] = sub[index[local], columns]
    cols = torch.zeros((len(keep), width), dtype=torch.long, device=logits.device)
    cols[local, place] = columns
    rows = [structured[i] for i in keep]
    return NarrowRows(rows, values, cols)


def draw(logits: torch.Tensor, seqs: list[Sequence], u: torch.Tensor) -> torch.Tensor:
    """One inverse-CDF draw per row from its filtered distribution (row r uses u[r])."""
    def col(name: str, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([getattr(s.params, name) for s in seqs], dtype=dtype)

    probs = filtered_probs(logits, col("temperature"), col("top_k", torch.long),
                           col("top_p"), col("min_p"))
    return sample_inverse_cdf(probs.double(), u.to(probs.device))
