"""The suffix drafter's tree against a brute-force oracle that scans the cached sequences.

The oracle knows nothing of the tree: a path's occurrence count is the number of positions
where it appears in the cached sequences, the match is the longest suffix of the context that
appears followed by a token, and a draft token is a most frequent next token of the path so
far. Random corpora over a 3-4 token alphabet make long repeated paths, ties and shared
branches common; evictions run in LRU order and in arbitrary order.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedq.worker.engine.suffix_tree import MIN_TOKEN_PROB, Node, SuffixCorpus, SuffixTree


class Oracle:
    """The cached sequences, scanned."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.sources: dict[int, tuple[int, ...]] = {}

    def occurrences(self, path: tuple[int, ...]) -> list[int]:
        """The sequence id of each occurrence of ``path``."""
        n = len(path)
        return [sid for sid, toks in self.sources.items()
                for i in range(len(toks) - n + 1) if toks[i:i + n] == path]

    def match_length(self, context: list[int], max_length: int) -> int:
        top = min(max_length, self.max_depth - 1, len(context))
        for n in range(top, 0, -1):
            path = tuple(context[len(context) - n:])
            if any(self.occurrences(path + (x,)) for x in self.alphabet()):
                return n
        return 0

    def alphabet(self) -> set[int]:
        return {t for toks in self.sources.values() for t in toks}

    def next_counts(self, path: tuple[int, ...]) -> dict[int, list[int]]:
        """Next token -> the sequence ids of its occurrences after ``path``."""
        out: dict[int, list[int]] = {}
        for x in self.alphabet():
            occ = self.occurrences(path + (x,))
            if occ:
                out[x] = occ
        return out

    def check_draft(self, context: list[int], n: int, k: int, draft: list[int],
                    exact_ties: bool) -> None:
        """``draft`` is a greedy most-frequent walk from the context's last ``n`` tokens that
        stops exactly where the oracle's walk stops."""
        path = tuple(context[len(context) - n:])
        room = min(k, self.max_depth - n)
        for step in range(room + 1):
            nexts = self.next_counts(path)
            total = len(self.occurrences(path))
            top = max((len(v) for v in nexts.values()), default=0)
            stops = step == room or top == 0 or top < MIN_TOKEN_PROB * total
            if stops:
                assert len(draft) == step, (path, draft, nexts)
                return
            assert len(draft) > step, (path, draft, nexts)
            token = draft[step]
            assert len(nexts.get(token, [])) == top, (path, token, nexts)
            if exact_ties:  # ties: a token of the most recent sequence among them
                newest = max(max(v) for v in nexts.values() if len(v) == top)
                assert max(nexts[token]) == newest, (path, token, nexts)
            path += (token,)


def node_paths(tree: SuffixTree) -> list[tuple[tuple[int, ...], Node]]:
    out, stack = [], [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for child in node.children.values():
            out.append((path + child.label, child))
            stack.append((path + child.label, child))
    return out


def check_structure(tree: SuffixTree, oracle: Oracle) -> None:
    """Every node's count is its path's occurrence count; no unary node that no suffix ends
    at (compressed); the totals match a fresh build of the same sequences."""
    nodes = node_paths(tree)
    for path, node in nodes:
        assert node.count == len(oracle.occurrences(path)), path
        assert node.label and len(path) <= tree.max_depth
        assert not (len(node.children) == 1 and
                    next(iter(node.children.values())).count == node.count), path
    assert tree.num_nodes == len(nodes)
    assert tree.label_tokens == sum(len(n.label) for _, n in nodes)
    fresh = SuffixTree(tree.max_depth)
    for sid, toks in oracle.sources.items():
        fresh.insert(toks, sid)
    assert (fresh.num_nodes, fresh.label_tokens) == (tree.num_nodes, tree.label_tokens)


seqs = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=18), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(seqs, st.integers(2, 7), st.integers(1, 5), st.randoms(use_true_random=False))
def test_match_and_draft_equal_the_scan(sources, depth, k, rnd):
    tree, oracle = SuffixTree(depth), Oracle(depth)
    for sid, toks in enumerate(sources):
        tree.insert(toks, sid)
        oracle.sources[sid] = tuple(toks)
    check_structure(tree, oracle)
    for _ in range(6):
        context = [rnd.randrange(4) for _ in range(rnd.randrange(1, 10))]
        if rnd.random() < 0.5 and any(sources):  # a context that ends in a cached span
            toks = rnd.choice([s for s in sources if s])
            context += toks[:rnd.randrange(1, len(toks) + 1)]
        found = tree.match(context, depth - k)
        n = oracle.match_length(context, depth - k)
        assert (found.length if found else 0) == n
        if found:
            draft, _ = tree.draft(found, k)
            oracle.check_draft(context, n, k, draft, exact_ties=True)


@settings(max_examples=100, deadline=None)
@given(seqs, seqs, st.integers(2, 7), st.randoms(use_true_random=False))
def test_removal_leaves_the_tree_of_the_rest(first, second, depth, rnd):
    tree, oracle = SuffixTree(depth), Oracle(depth)
    live: dict[int, list[int]] = {}
    for sid, toks in enumerate(first + second):
        tree.insert(toks, sid)
        oracle.sources[sid] = tuple(toks)
        live[sid] = toks
        if rnd.random() < 0.5:  # evict a random one, not only the oldest
            gone = rnd.choice(sorted(live))
            tree.remove(live.pop(gone))
            del oracle.sources[gone]
        check_structure(tree, oracle)
    for sid in sorted(live):
        tree.remove(live.pop(sid))
        del oracle.sources[sid]
        check_structure(tree, oracle)
    assert (tree.num_nodes, tree.label_tokens, tree.root.count) == (0, 0, 0)
    assert not tree.root.children


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=14), min_size=1, max_size=12),
       st.integers(1, 4), st.randoms(use_true_random=False))
def test_corpus_is_lru_bounded_and_drafts_like_the_scan(sources, cap, rnd):
    """The corpus holds at most ``cap`` requests, the least recently used (added or drafted
    from) leave first, and its drafts are the scan's over what it holds."""
    depth, k = 8, 3
    corpus = SuffixCorpus(max_requests=cap, min_n=1, max_depth=depth)
    order: list[int] = []  # the oracle's LRU order of sequence ids
    held: dict[int, tuple[int, ...]] = {}
    next_id = 0
    for toks in sources:
        if len(toks) > 1:
            while len(held) >= cap:
                held.pop(order.pop(0))
            held[next_id] = tuple(toks)
            order.append(next_id)
            next_id += 1
        corpus.add(toks)
        assert len(corpus) == len(held) <= cap
        assert corpus.num_tokens == sum(map(len, held.values()))
        oracle = Oracle(depth)
        oracle.sources = dict(held)
        check_structure(corpus.tree, oracle)
        context = [rnd.randrange(3) for _ in range(rnd.randrange(1, 6))]
        n, draft = corpus.propose(context, k)
        assert n == oracle.match_length(context, depth - k)
        if n:
            oracle.check_draft(context, n, k, draft, exact_ties=False)
        found = corpus.tree.match(context, depth - k)
        if found:  # the same lookup's sequences were used: they move to the back
            _, used = corpus.tree.draft(found, k)
            for sid in used:
                if sid in held:
                    order.remove(sid)
                    order.append(sid)
        assert list(corpus._sources) == order


def test_a_pipeline_drafts_the_majority_continuation():
    """Three jobs continued "A B" with C, one later with D: the draft follows the majority,
    where the latest-occurrence rule of an n-gram index would propose D."""
    corpus = SuffixCorpus(max_requests=10, min_n=2, max_depth=16)
    for tail in (7, 7, 7, 9):
        corpus.add([1, 2, 3, 4, tail, 5])
    assert corpus.propose([0, 3, 4], 2) == (2, [7, 5])
    assert corpus.propose([1, 2, 3, 4], 3) == (4, [7, 5])


def test_depth_bounds_match_plus_draft_and_memory():
    tree = SuffixTree(max_depth=6)
    toks = list(range(40))
    tree.insert(toks, 0)
    found = tree.match(toks[:30], max_length=4)
    assert found is not None and found.length == 4
    assert tree.draft(found, 5)[0] == [30, 31]  # 4 matched + 2 drafted = depth 6
    # at most two nodes per suffix, labels at most max_depth each
    assert tree.num_nodes <= 2 * len(toks) and tree.label_tokens <= 6 * len(toks)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixTree(1)


def test_large_corpus_stays_bounded():
    rng = random.Random(0)
    corpus = SuffixCorpus(max_requests=20, min_n=2, max_depth=24)
    for _ in range(200):
        corpus.add([rng.randrange(50) for _ in range(rng.randrange(50, 150))])
    assert len(corpus) == 20
    stats = corpus.stats()
    assert stats["spec_suffix_nodes"] <= 2 * stats["spec_suffix_tokens"]
