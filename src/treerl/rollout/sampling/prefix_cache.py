"""The embedded sampler's prefix cache: a radix tree over token ids whose nodes hold the K/V of their tokens.

Step 1 (docs/architecture.md): what generation has computed, kept across calls so that no prefix is computed twice.

Every prompt and every completion the sampler generates is inserted (a completion's tokens but its last, which no
forward ran; not the last chunk of a call its caller says nothing reads after, `EmbeddedSampler.unread()`); a later
call reads the longest cached prefix of each prompt and prefills only the rest: a multi-turn
episode's next turn, a branch's sibling, an agent's next request, a GRPO group whose system prompt the previous call
computed. A node holds the K/V of its tokens once (`KVRun`), a hybrid model's recurrent states after its last token
(a cached prefix of a hybrid is usable only up to a node end that holds them) and, when the sampler records an MoE
model's routing, each token's experts.

Bounded: at most `max_tokens` tokens, and never more than `MEMORY_SHARE` of the memory free beside it; the least
recently used leaves go first. A sequence that cannot fit is not stored (counted) and is computed again when next
asked for. Keyed by the weights: `sync(key)` empties the cache whenever the key (policy version, and the parameters'
own version counters) changes, so a K/V of older weights is never read.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from treerl.attention.prefix_attention import KVRun

DEFAULT_TOKENS = 32768  # rollout.prefix_cache_tokens's default
MEMORY_SHARE = 0.25  # of the memory free beside the cache (host RAM, or the model's GPU): the most the cache holds
States = dict[tuple[int, str, int], torch.Tensor]  # a hybrid's recurrent states after a token (treerl.engine.recurrent)


@dataclass
class CachedPrefix:
    """What the cache holds of a prompt: its first `depth` tokens, as the runs (and how much of each) on their path,
    the recurrent states after them (a hybrid), their routes (an MoE model's, when recorded)."""

    depth: int = 0
    reads: list[tuple[KVRun, int]] = field(default_factory=list)
    states: States | None = None
    routes: list[torch.Tensor] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        """Which position of the cache this is (prompts with the same key share everything before it)."""
        return tuple((id(run), used) for run, used in self.reads)


class _Node:
    __slots__ = ("children", "kv", "parent", "routes", "states", "tokens", "used")

    def __init__(self, tokens: list[int], kv: KVRun | None, parent: _Node | None, routes: torch.Tensor | None = None):
        self.tokens, self.kv, self.parent, self.routes = tokens, kv, parent, routes
        self.states: States | None = None
        self.children: dict[int, _Node] = {}
        self.used = 0

    @property
    def nbytes(self) -> int:
        states = sum(s.nbytes for s in self.states.values()) if self.states else 0
        return self.kv.nbytes + states + (self.routes.nbytes if self.routes is not None else 0)


@dataclass
class CacheCounts:
    """What the cache did, summed since the sampler was made (the rollout reports each step's difference)."""

    stored_tokens: int = 0  # tokens inserted
    evicted_tokens: int = 0  # tokens evicted to stay within the bounds
    unstored_tokens: int = 0  # tokens of sequences too large to store (computed again when next asked for)
    invalidations: int = 0  # times the cache was emptied because the weights changed


class PrefixCache:
    """A bounded radix tree of computed prefixes (see the module docstring); not thread-safe: the sampler locks."""

    def __init__(self, max_tokens: int, memory_share: float = MEMORY_SHARE):
        self.max_tokens, self.memory_share = max_tokens, memory_share
        self.root = _Node([], None, None)
        self.tokens = self.bytes = 0
        self.key: object = None
        self.counts = CacheCounts()
        self._clock = itertools.count(1)

    def sync(self, key: object) -> None:
        """Empty the cache if `key` (what the weights are) is not the one its entries were computed with."""
        if key != self.key:
            if self.tokens:
                self.counts.invalidations += 1
            self.clear()
            self.key = key

    def clear(self) -> None:
        self.root = _Node([], None, None)
        self.tokens = self.bytes = 0

    def match(self, tokens: list[int], limit: int, needs_states: bool) -> CachedPrefix:
        """The longest cached prefix of `tokens`, at most `limit` tokens; with `needs_states`, only up to the end of
        a node that holds recurrent states."""
        found = CachedPrefix()
        node, depth = self.root, 0
        path: list[tuple[KVRun, int, torch.Tensor | None]] = []
        best = CachedPrefix()
        while depth < limit:
            child = node.children.get(tokens[depth])
            if child is None:
                break
            same = _common(child.tokens, tokens, depth, limit)
            child.used = next(self._clock)
            path.append((child.kv, same, child.routes))
            depth += same
            if same < len(child.tokens):
                break
            node = child
            if child.states is not None:
                best = _prefix(path, depth, child.states)
        if not needs_states:
            found = _prefix(path, depth, None)
            return found
        return best

    def insert(self, tokens: list[int], kv_of: Callable[[int, int], KVRun], states: dict[int, States] | None = None,
               routes_of: Callable[[int, int], torch.Tensor | None] | None = None) -> None:
        """Store `tokens` (their K/V for positions [a, b) from `kv_of(a, b)`, a copy the cache may keep); `states`:
        a hybrid's recurrent states after some of its tokens (depth -> states). `evict` after a batch of them brings the
        cache back within its bounds."""
        if self.max_tokens <= 0 or not tokens:
            return
        states = states or {}
        cuts = sorted({d for d in states if 0 < d < len(tokens)} | {len(tokens)})
        new = len(tokens) - self._cached_depth(tokens)
        if new > self._limit_tokens():
            self.counts.unstored_tokens += new
            return
        node, depth = self.root, 0
        while depth < len(tokens):
            end = next(c for c in cuts if c > depth)
            child = node.children.get(tokens[depth])
            if child is None:
                kv = kv_of(depth, end)
                child = _Node(tokens[depth:end], kv, node, routes_of(depth, end) if routes_of else None)
                node.children[tokens[depth]] = child
                self._account(child, +1)
                self.counts.stored_tokens += end - depth
            else:
                same = _common(child.tokens, tokens, depth, end)
                if same < len(child.tokens):
                    child = self._split(child, same)
            child.used = next(self._clock)
            depth += len(child.tokens)
            if depth in states and child.states is None:
                child.states = states[depth]
                self.bytes += sum(s.nbytes for s in child.states.values())
            node = child

    def evict(self) -> None:
        """Least recently used leaves out until the cache is within its bounds."""
        limit_tokens, limit_bytes = self._limit_tokens(), self._limit_bytes()
        if self.tokens <= limit_tokens and self.bytes <= limit_bytes:
            return
        leaves = [(n.used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while leaves and (self.tokens > limit_tokens or self.bytes > limit_bytes):
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self._account(leaf, -1)
            self.counts.evicted_tokens += len(leaf.tokens)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.used, id(parent), parent))

    def _cached_depth(self, tokens: list[int]) -> int:
        node, depth = self.root, 0
        while depth < len(tokens) and (child := node.children.get(tokens[depth])) is not None:
            same = _common(child.tokens, tokens, depth, len(tokens))
            depth += same
            if same < len(child.tokens):
                break
            node = child
        return depth

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node` after `at` tokens: the upper part becomes a new node above it (each part a copy of its K/V, so
        that evicting one frees its memory); returns the upper part."""
        kv = node.kv
        upper = _Node(node.tokens[:at], _copied(kv.piece(kv.start, kv.start + at)), node.parent,
                      None if node.routes is None else node.routes[:at].clone())
        upper.used = node.used
        node.parent.children[node.tokens[0]] = upper
        before = node.nbytes
        node.tokens = node.tokens[at:]
        node.kv = _copied(kv.piece(kv.start + at, kv.start + kv.length))
        node.routes = None if node.routes is None else node.routes[at:].clone()
        node.parent = upper
        upper.children[node.tokens[0]] = node
        self.bytes += upper.nbytes + node.nbytes - before
        return upper

    def _account(self, node: _Node, sign: int) -> None:
        self.tokens += sign * len(node.tokens)
        self.bytes += sign * node.nbytes

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _limit_tokens(self) -> int:
        return max(0, self.max_tokens)

    def _limit_bytes(self) -> float:
        """`memory_share` of what is free beside the cache (the host's available memory, or the GPU's)."""
        device = next((n.kv.keys[s].device for n in self.root.children.values() for s in n.kv.keys), None)
        if device is not None and device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = psutil.virtual_memory().available
        return self.memory_share * (free + self.bytes)


def _common(cached: list[int], tokens: list[int], depth: int, end: int) -> int:
    """How many of `cached` equal `tokens[depth:end]` from the start."""
    n = min(len(cached), end - depth)
    for i in range(n):
        if cached[i] != tokens[depth + i]:
            return i
    return n


def _prefix(path: list[tuple[KVRun, int, torch.Tensor | None]], depth: int, states: States | None) -> CachedPrefix:
    """The cached prefix of `depth` tokens along `path` (its runs from the root)."""
    reads, routes, left = [], [], depth
    for kv, used, route in path:
        take = min(used, left)
        if take <= 0:
            break
        reads.append((kv, take))
        if route is not None:
            routes.append(route[:take])
        left -= take
    return CachedPrefix(depth, reads, states, routes)


def _copied(kv: KVRun) -> KVRun:
    return KVRun(kv.start, kv.length, {s: k.clone() for s, k in kv.keys.items()},
                 {s: v.clone() for s, v in kv.values.items()})
