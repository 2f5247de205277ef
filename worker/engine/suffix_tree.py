"""A depth-bounded generalized suffix tree over recent requests' tokens (SuffixDecoding's
structure, arXiv 2411.04975), with occurrence counts, LRU eviction and a draft walk.

Why a tree and not an n-gram index: a pipeline's thousandth similar job should draft the
continuation that most of the 999 before it took, not merely the latest one, and it should
match as far back as the jobs agree (``max_depth`` tokens), not a fixed 2..5 tokens. Every
suffix of every cached sequence, cut to ``max_depth`` tokens, is a path from the root; a node
counts the suffixes through it, which is the number of times its path occurs in the corpus.

- Edges are path-compressed: an edge holds a tuple of tokens, so the tree has at most two
  nodes per inserted suffix (not one per token and depth as a plain trie would).
- ``remove`` takes a sequence's suffixes out again (counts down, empty subtrees dropped,
  unary nodes merged back into their child), so the tree after an eviction is the tree of the
  remaining sequences: memory is bounded by the cached requests (LRU, ``SuffixCorpus``).
- ``match`` finds the longest suffix of a context that occurs with a continuation, at most
  ``max_depth - k`` tokens (vLLM's rule: match plus draft stay within the tree depth);
  ``draft`` then follows the most frequent child (ties: the most recent sequence) while the
  child keeps at least ``min_prob`` of its parent's occurrences.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

MIN_TOKEN_PROB = 0.1  # vLLM's suffix_decoding_min_token_prob default


class Node:
    """One tree node: the edge into it (``label``), its occurrence count and its children by
    first token; ``latest`` is the id of the newest sequence whose suffix passed through it."""

    __slots__ = ("children", "count", "label", "latest")

    def __init__(self, label: tuple[int, ...], count: int = 0, latest: int = -1) -> None:
        self.label = label
        self.count = count
        self.latest = latest
        self.children: dict[int, Node] = {}


@dataclass(frozen=True)
class Match:
    """Where a context's longest matching suffix ends in the tree: ``node`` and how many of
    its label's tokens the match used (``offset``), and the match's length in tokens."""

    node: Node
    offset: int
    length: int


class SuffixTree:
    """Generalized suffix tree of token sequences, each suffix cut to ``max_depth`` tokens."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be >= 2: one token to match and one to draft")
        self.max_depth = max_depth
        self.root = Node(())
        self.num_nodes = 0  # without the root
        self.label_tokens = 0  # tokens held in edge labels (the tree's memory, with the nodes)

    # -- building ----------------------------------------------------------------------------
    def insert(self, tokens: Tokens[int], sid: int) -> None:
        """Add every suffix of ``tokens`` (cut to max_depth), tagged as sequence ``sid``."""
        for i in range(len(tokens)):
            self._insert(tuple(tokens[i:i + self.max_depth]), sid)

    def _insert(self, path: tuple[int, ...], sid: int) -> None:
        node, i = self.root, 0
        node.count += 1
        while i < len(path):
            child = node.children.get(path[i])
            if child is None:
                self._add_child(node, Node(path[i:], 1, sid))
                return
            j = _common(child.label, path, i)
            if j < len(child.label):  # the path leaves (or ends inside) the edge: split it
                child = self._split(node, child, j)
            child.count += 1
            child.latest = sid
            node, i = child, i + j

    def _add_child(self, parent: Node, child: Node) -> None:
        parent.children[child.label[0]] = child
        self.num_nodes += 1
        self.label_tokens += len(child.label)

    def _split(self, parent: Node, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new middle node."""
        mid = Node(child.label[:at], child.count, child.latest)
        child.label = child.label[at:]
        mid.children[child.label[0]] = child
        parent.children[mid.label[0]] = mid
        self.num_nodes += 1
        return mid

    def remove(self, tokens: Tokens[int]) -> None:
        """Take ``tokens``' suffixes out again (it must have been inserted)."""
        for i in range(len(tokens)):
            self._remove(tuple(tokens[i:i + self.max_depth]))

    def _remove(self, path: tuple[int, ...]) -> None:
        node, i = self.root, 0
        node.count -= 1
        trail: list[Node] = [node]
        while i < len(path):
            child = node.children[path[i]]
            child.count -= 1
            if child.count == 0:  # nothing else passes here: the whole subtree goes
                del node.children[path[i]]
                self._forget(child)
                break
            trail.append(child)
            node, i = child, i + len(child.label)
        self._compact(trail)

    def _forget(self, node: Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            self.num_nodes -= 1
            self.label_tokens -= len(n.label)
            stack.extend(n.children.values())

    def _compact(self, trail: list[Node]) -> None:
        """Merge each node of ``trail`` that no suffix ends at and that has one child into that
        child (the tree a fresh build of the remaining sequences would have)."""
        parent = trail[0]
        for node in trail[1:]:
            only = next(iter(node.children.values())) if len(node.children) == 1 else None
            if only is None or only.count != node.count:
                parent = node
                continue
            only.label = node.label + only.label  # same tokens: label_tokens is unchanged
            parent.children[only.label[0]] = only
            self.num_nodes -= 1  # ``only`` now hangs from ``parent``, which stays the parent

    # -- drafting ----------------------------------------------------------------------------
    def match(self, context: Tokens[int], max_length: int) -> Match | None:
        """The longest suffix of ``context`` (at most ``max_length`` tokens) that occurs in the
        tree with at least one token after it; None when not even one token does.

        Binary search on the length: a suffix that occurs with a continuation has every shorter
        suffix occur with one too (the same occurrence), so the property is monotone."""
        low, high, best = 1, min(max_length, self.max_depth - 1, len(context)), None
        while low <= high:
            n = (low + high) // 2
            found = self._walk(context[len(context) - n:])
            if found is not None and _has_next(found):
                best, low = found, n + 1
            else:
                high = n - 1
        return best

    def _walk(self, path: Tokens[int]) -> Match | None:
        node, i = self.root, 0
        while i < len(path):
            child = node.children.get(path[i])
            if child is None:
                return None
            j = _common(child.label, path, i)
            if i + j < len(path) and j < len(child.label):
                return None
            if i + j == len(path):
                return Match(child, j, len(path))
            node, i = child, i + j
        return Match(node, len(node.label), len(path))

    def draft(self, found: Match, k: int,
              min_prob: float = MIN_TOKEN_PROB) -> tuple[list[int], list[int]]:
        """Up to ``k`` tokens after ``found`` (never past max_depth), each the most frequent
        continuation of the path so far while it keeps ``min_prob`` of the occurrences; and the
        sequence ids (``latest``) the drafted tokens came from."""
        room = min(k, self.max_depth - found.length)
        out: list[int] = []
        used = [found.node.latest]
        node, offset = found.node, found.offset
        while len(out) < room:
            if offset < len(node.label):  # inside an edge: one way on, same count
                out.append(node.label[offset])
                offset += 1
                continue
            best = _best_child(node)
            if best is None or best.count < min_prob * node.count:
                break
            used.append(best.latest)
            node, offset = best, 0
        return out, used


def _common(label: tuple[int, ...], path: Tokens[int], start: int) -> int:
    """How many leading tokens of ``label`` equal ``path[start:]``'s."""
    n = min(len(label), len(path) - start)
    j = 0
    while j < n and label[j] == path[start + j]:
        j += 1
    return j


def _has_next(found: Match) -> bool:
    return found.offset < len(found.node.label) or bool(found.node.children)


def _best_child(node: Node) -> Node | None:
    """The child with the most occurrences; ties go to the most recent sequence."""
    best = None
    for child in node.children.values():
        if best is None or (child.count, child.latest) > (best.count, best.latest):
            best = child
    return best


class SuffixCorpus:
    """The prompts and outputs of recent requests in a suffix tree, least recently used out
    first once ``max_requests`` are held; a request is used when a draft came from it."""

    def __init__(self, max_requests: int, min_n: int, max_depth: int) -> None:
        self.max_requests = max_requests
        self.min_n = min_n
        self.tree = SuffixTree(max_depth)
        self._sources: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._next_id = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._sources)

    def add(self, tokens: Tokens[int]) -> None:
        """Index one finished request's prompt and output (evicting the least recently used
        request first when full)."""
        if len(tokens) <= self.min_n:
            return
        while len(self._sources) >= self.max_requests:
            _, old = self._sources.popitem(last=False)
            self.tree.remove(old)
            self.num_tokens -= len(old)
        sid, self._next_id = self._next_id, self._next_id + 1
        kept = tuple(tokens)
        self._sources[sid] = kept
        self.num_tokens += len(kept)
        self.tree.insert(kept, sid)

    def propose(self, context: Tokens[int], k: int) -> tuple[int, list[int]]:
        """(match length, draft of up to ``k`` tokens) for ``context``; (0, []) when its last
        ``min_n`` tokens never occurred with a continuation."""
        found = self.tree.match(context, self.tree.max_depth - k)
        if found is None or found.length < self.min_n:
            return 0, []
        draft, used = self.tree.draft(found, k)
        for sid in used:  # drafted from: keep those requests longest
            if sid in self._sources:
                self._sources.move_to_end(sid)
        return found.length, draft

    def stats(self) -> dict[str, int]:
        return {"spec_suffix_requests": len(self._sources),
                "spec_suffix_tokens": self.num_tokens,
                "spec_suffix_nodes": self.tree.num_nodes,
                "spec_suffix_label_tokens": self.tree.label_tokens}
