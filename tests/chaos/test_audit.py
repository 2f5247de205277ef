"""The chaos audit's own oracle: transformers tells a near-tie flip apart from a protocol
fault, and a shuffled load's flips are bounded."""

from __future__ import annotations

import pytest

from pagedq.params import SamplingParams
from tests.chaos import harness
from tests.chaos.harness import Audit, Job, expected_tokens, near_tie


@pytest.fixture
def runs(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    jobs = [Job([5, 9, 2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
            Job([7, 1], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24,
                                       ignore_eos=True))]
    return model, list(zip(jobs, expected_tokens(model, jobs), strict=True))


def _second_choice(model, job, tokens, pos):
    """A token other than tokens[pos] that transformers ranks high there."""
    from tests.oracle import hf_logits

    row = hf_logits(model, job.prompt + tokens)[len(job.prompt) - 1 + pos]
    return next(t for t in row.topk(2).indices.tolist() if t != tokens[pos])


def test_transformers_agrees_with_the_engine_on_every_token(runs):
    """The judge's replica of the sampler (argmax; the seeded inverse-CDF draw) on transformers'
    logits picks the engine's tokens: a stream equal to the engine's run is within tolerance
    everywhere (against itself, near_tie reports no difference)."""
    model, pairs = runs
    for job, samples in pairs:
        got = [list(s) for s in samples]
        assert near_tie(model, job, got, got) == "(transformers: near-tie at positions " \
            f"{[len(s) for s in got]})"


def test_a_far_token_is_never_a_flip(runs):
    model, pairs = runs
    for job, samples in pairs:
        true = [list(s) for s in samples]
        other = [list(s) for s in true]
        other[-1][10] = _second_choice(model, job, true[-1], 10) if job.params.greedy \
            else (other[-1][10] + 1) % 300
        # the reference picked a token transformers does not call a tie: not a flip
        assert near_tie(model, job, true, other) == ""
        # the stream has a wrong token and then carries on as if it had not: not a flip
        assert near_tie(model, job, other, true) == ""
        shifted = [s[:5] + s[6:] + [s[5]] for s in true]  # a token lost, another repeated
        assert near_tie(model, job, shifted, true) == ""


def test_a_tie_within_tolerance_is_a_flip(runs, monkeypatch):
    """With the tolerance widened past the gap at one position, the same difference is a
    flip: the verdict turns on transformers' gap there, not on the engine."""
    model, pairs = runs
    job, samples = pairs[0]  # greedy
    true = [list(s) for s in samples]
    other = [list(s) for s in true]
    other[0][10] = _second_choice(model, job, true[0], 10)
    assert near_tie(model, job, true, other) == ""
    monkeypatch.setattr(harness, "TIE_LOGIT", 1e9)
    assert near_tie(model, job, true, other) == "(transformers: near-tie at positions [10])"


def test_flips_are_bounded():
    audit = Audit(total=45, done=40, flipped=5, tokens=6000)
    assert audit.max_flips == 6 and audit.explained and not audit.clean
    assert not Audit(total=45, done=38, flipped=7, tokens=6000).explained
    assert Audit(total=30, done=29, flipped=1, tokens=986).clean  # one chance flip in a short run
    assert not Audit(total=30, done=28, flipped=2, tokens=986).clean


def test_a_cluster_that_skips_or_fails_leaves_no_server(tmp_path, monkeypatch):
    """LocalCluster.start: a skip (no redis-cli) starts no node; a failure after the nodes
    started (the cluster could not be created) stops all six."""
    from tests.chaos import servers

    monkeypatch.setattr(servers, "SYSTEM_CLI", str(tmp_path / "no-redis-cli"))
    monkeypatch.setattr(servers.shutil, "which", lambda name: None)
    monkeypatch.delenv("PAGEDQ_REQUIRE_SERVERS", raising=False)
    cluster = servers.LocalCluster(tmp_path / "skipped")
    with pytest.raises(pytest.skip.Exception):
        cluster.start()
    assert all(n.process is None for n in cluster.nodes)

    monkeypatch.setattr(servers, "cli_binary", lambda: "/bin/false")  # `--cluster create` fails
    cluster = servers.LocalCluster(tmp_path / "failed")
    with pytest.raises(AssertionError):
        cluster.start()
    assert all(n.process is not None and n.process.poll() is not None for n in cluster.nodes)


def test_a_clusters_ports_never_meet_each_others_bus_ports():
    """cluster_port: six nodes' client and bus ports are twelve distinct ports, the client
    ports below 30,000 and the bus ports in 30,000-32,767, under the kernel's ephemeral range
    (CI once saw one node's client port taken as another's bus port: the node aborted); a
    standalone server's port lies in neither range."""
    from tests.chaos import servers

    for _ in range(50):
        taken: set[int] = set()
        ports = [servers.cluster_port(taken) for _ in range(6)]
        pairs = {p for port in ports for p in (port, port + 10_000)}
        assert len(pairs) == 12 and pairs == taken
        assert all(20_000 <= p < 22_768 for p in ports)
    assert all(23_000 <= servers.server_port() < 30_000 for _ in range(20))
