"""Generation that computes every shared prefix once: the embedded sampler's default path.

Step 1 (docs/architecture.md): how the embedded sampler prefills and decodes.

A call's prompts, after the longest prefix of each that the prefix cache holds (treerl.rollout.sampling.prefix_cache), form a
trie: each trie node is run through the model once, its tokens attending to the K/V of every run above it (cached
nodes, then its trie ancestors) and causally to themselves, and its K/V is stored once. Decoding then reads that one
copy: each row's attention is the log-sum-exp merge of one kernel call per run on its path, the queries of every
active row below the run folded into one block of queries, and of its own generated tokens
(treerl.attention.prefix_attention). Rows are dropped as they stop. A hybrid model's recurrent state goes from each
node to its children and is forked per row (a fixed-size copy) for decoding.

Rows run in the trie's order (each run's rows contiguous); logits and tokens go in and out in the order of today's
padded path (prompt-major, n rows a prompt), so one seeded draw per step over the same rows samples the same tokens.

A model this path cannot serve exactly (its attention in its own code, an indexer's choice of keys, chunked
attention, a mixer whose state it does not hand on) is found by `refusal`, once per model, before anything is
sampled: checks and a probe against the model's own forward. The sampler then generates the padded way.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treerl.attention import CALL_KWARG, Segment, UnsupportedModel, engine_attention
from treerl.attention.prefix_attention import KVRun, PrefixCall, Read, RowKV, joined
from treerl.engine.base import attends_in_own_code, check_tree_engine, final_hidden
from treerl.engine.head import logit_transform
from treerl.engine.recurrent import Mixers, compressed_entries
from treerl.engine.routing import RouteRecord
from treerl.engine.selective_scan import continued_scans
from treerl.engine.support import attention_layers, check_all_layers_routed, model_name
from treerl.rollout.sampling.prefix_cache import CachedPrefix, PrefixCache, States
from treerl.rollout.sampling.sampler import Completion

PREFILL_TOKENS = 4096  # most tokens of one prefill call (longer trie nodes become chains)
COPIED_TOKENS = 256  # a stretch of a prompt that rows read, copied into each reader's own buffer when the copies
# (readers - 1 of them) hold at most this many tokens: a kernel call a step costs more than reading those
SHARING_COST = 20_000_000  # parameters x prefill tokens: what a wave of the trie's prefill costs beyond the padded
# path's one call, in prefill the model could run instead (`pays`)


@dataclass
class PrefixCounts:
    """What the embedded sampler computed and reused, summed since it was made (the rollout logs each step's part)."""

    prompt_tokens: int = 0  # tokens of the prompts asked for (what prefilling each prompt whole would run)
    prefill_tokens: int = 0  # tokens the prefills ran through the model
    cached_tokens: int = 0  # distinct prefix tokens whose K/V came from the prefix cache
    unshared_calls: int = 0  # generate calls that took the padded path (a model or images it cannot share; see log)
    padded_chunks: int = 0  # chunks it could share but ran the padded way, sharing would not pay (`pays`)

    def __sub__(self, other: PrefixCounts) -> PrefixCounts:
        return PrefixCounts(*(a - b for a, b in zip(vars(self).values(), vars(other).values())))

    @staticmethod
    def of(sampler: object) -> PrefixCounts | None:
        """A copy of a sampler's counts (None: a sampler that does not count them, a server's client)."""
        counts = getattr(sampler, "counts", None)
        return PrefixCounts(**vars(counts)) if isinstance(counts, PrefixCounts) else None


@dataclass(eq=False)
class CallNode:
    """A run of new tokens of a call's prompt trie at positions [start, start + len(tokens)), below `parent` (None:
    below its group's cached prefix)."""

    tokens: list[int]
    start: int
    parent: CallNode | None
    cached: CachedPrefix
    depth: int = 0  # in the call's trie: which prefill wave runs it
    kv: KVRun | None = None
    states: States | None = None  # a hybrid's recurrent states after its last token
    routes: torch.Tensor | None = None  # an MoE model's routes of its tokens, when recorded
    hidden: torch.Tensor | None = None  # the final hidden state of its last token, where a prompt ends

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def path(self) -> list[CallNode]:
        """The call nodes from its group's first down to it."""
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def reads(self) -> list[tuple[KVRun, int]]:
        """The runs its tokens attend to besides their own: the cached prefix's, then its call ancestors'."""
        return [*self.cached.reads, *((n.kv, len(n.tokens)) for n in self.path()[:-1])]

    def initial_states(self) -> States | None:
        """A hybrid's states before its first token: its parent's final ones, or the cached prefix's."""
        return self.parent.states if self.parent is not None else self.cached.states


# ---------------------------------------------------------------------------------------------- support


_REFUSALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None, or why the path cannot serve it


def refusal(model: PreTrainedModel) -> str | None:
    """Why this path cannot generate exactly with `model` (None: it can). Once per model: the tree engines' checks,
    then a probe: two prompts sharing a trie node, two decoding steps, against the model's own forward."""
    if model not in _REFUSALS:
        _REFUSALS[model] = _refusal(model)
    return _REFUSALS[model]


def _refusal(model: PreTrainedModel) -> str | None:
    try:
        mixers = check_tree_engine(model, carries_state=True)
    except UnsupportedModel as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a model the checks cannot even run on is not shared
        return f"{model_name(model)}: {type(e).__name__}: {e}"
    if attends_in_own_code(model):
        return f"{model_name(model)}: its layers compute attention in their own code over their cache's K/V"
    if mixers.indexed or mixers.compression:
        return f"{model_name(model)}: sparse or compressed attention keeps per-token keys the sampler does not store"
    try:
        return _probe(model, mixers)
    except UnsupportedModel as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure of the probe is a refusal, with its cause
        return f"{model_name(model)}: the shared-prefix probe failed ({type(e).__name__}: {e})"


@torch.inference_mode()
def _probe(model: PreTrainedModel, mixers: Mixers) -> str | None:
    """Prompts [a b c] and [a b c d] (a shared node and a child), then tokens fed for two steps: each logit row
    against the model's own forward on [a b c d e f]."""
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    ids = ((torch.arange(6) * 7 + vocab // 3) % vocab).tolist()
    with torch.no_grad():
        own = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].double()
    decoding = SharedDecoding(model, [ids[:3], ids[:4]], 1, 2, PrefixCache(0), mixers, None, PrefixCounts())
    got = [decoding.logits, decoding.step(torch.tensor(ids[3:5], device=device)),
           decoding.step(torch.tensor(ids[4:6], device=device))]
    expected = [own[[2, 3]], own[[3, 4]], own[[4, 5]]]
    scale = float(own.abs().max().clamp_min(1e-30))
    off = max(float((g.double() - e).abs().max()) for g, e in zip(got, expected)) / scale
    tolerance = 1e-3 if next(model.parameters()).element_size() >= 4 else 5e-2
    if not off <= tolerance:
        return (f"{model_name(model)}: generation over shared prefixes is off the model's own forward by "
                f"{off:.2g} of the logits' scale")
    return None


def pays(model: PreTrainedModel, prompts: list[list[int]], nodes: list[CallNode]) -> bool:
    """Whether sharing this chunk's prefixes pays where the prefix cache is neither read nor kept: the shared path
    prefills in one model call a trie level (a wave), the padded path in one call, and decodes with a kernel call a
    run and layer: host work a tiny model does not earn back. It pays when the prefill tokens it saves (the padded
    batch's, prompts x the longest, less the trie's) reach `SHARING_COST / parameters` a wave: ~230 for the 0.09 M
    parameters of `treerl train`'s demo model (its 16 prompts of 8 tokens save 60-76 in 3 waves: padded), under one
    for SmolLM2-135M (any shared token). Both paths measured side by side on both models (docs/benchmarks.md, "The
    tiny demo model"): the tiny model's shared path breaks even at ~300 saved tokens a wave, SmolLM2-135M's at ~30;
    the rule errs toward sharing, which every call took before."""
    width = max(len(p) for p in prompts)
    saved = len(prompts) * width - sum(len(node.tokens) for node in nodes)
    waves = 1 + max(node.depth for node in nodes)
    return saved * sum(p.numel() for p in model.parameters()) >= waves * SHARING_COST


# ---------------------------------------------------------------------------------------------- the trie


def call_trie(prompts: list[list[int]], cache: PrefixCache,
              needs_states: bool) -> tuple[list[CallNode], list[CallNode]]:
    """The call's trie of what the cache does not hold: its nodes in preorder (the runs any node reads are those of
    a contiguous stretch of nodes), and the node each prompt ends in. Each prompt's last token is always computed
    (its logits start the sampling)."""
    groups: dict[tuple, tuple[CachedPrefix, list[int]]] = {}
    for i, prompt in enumerate(prompts):
        cached = cache.match(prompt, len(prompt) - 1, needs_states)
        groups.setdefault(cached.key, (cached, []))[1].append(i)
    nodes: list[CallNode] = []
    ends: list[CallNode | None] = [None] * len(prompts)
    for key in sorted(groups, key=lambda k: tuple(i for pair in k for i in pair)):
        cached, members = groups[key]
        _grow([(i, prompts[i][cached.depth :]) for i in members], cached.depth, None, cached, PREFILL_TOKENS, nodes,
              ends)
    return nodes, ends  # type: ignore[return-value]


def _grow(items: list[tuple[int, list[int]]], start: int, parent: CallNode | None, cached: CachedPrefix, chunk: int,
          nodes: list[CallNode], ends: list[CallNode | None]) -> None:
    """The trie of `items` (prompt index, its tokens from `start`) below `parent`, appended in preorder."""
    by_first: dict[int, list[tuple[int, list[int]]]] = {}
    for item in items:
        by_first.setdefault(item[1][0], []).append(item)
    for group in by_first.values():
        common = len(os.path.commonprefix([suffix for _, suffix in group]))
        tokens = group[0][1][:common]
        node = parent
        for lo in range(0, common, chunk):  # a long node as a chain of calls
            node = CallNode(tokens[lo : lo + chunk], start + lo, node, cached,
                            depth=0 if node is None else node.depth + 1)
            nodes.append(node)
        rest = []
        for i, suffix in group:
            if len(suffix) == common:
                ends[i] = node
            else:
                rest.append((i, suffix[common:]))
        if rest:
            _grow(rest, start + common, node, cached, chunk, nodes, ends)


Runs = list[tuple[KVRun, int]]  # runs of consecutive positions from the root, and how much of each


def _units(paths: list[Runs]) -> list[Runs]:
    """Each path's runs, consecutive runs that exactly the same paths read joined into one (a copy, made once for
    all of them): one kernel call instead of one a run, where a cache or a trie cut a stretch into pieces."""
    readers: dict[tuple[int, int], set[int]] = {}
    for i, path in enumerate(paths):
        for run, used in path:
            readers.setdefault((id(run), used), set()).add(i)
    made: dict[tuple, tuple[KVRun, int]] = {}

    def unit(chain: Runs) -> tuple[KVRun, int]:
        if len(chain) == 1:
            return chain[0]
        key = tuple((id(run), used) for run, used in chain)
        if key not in made:
            whole = joined([run.piece(run.start, run.start + used) for run, used in chain])
            made[key] = (whole, whole.length)
        return made[key]

    out = []
    for path in paths:
        units: Runs = []
        chain: Runs = []
        for run, used in path:
            if chain and readers[(id(chain[-1][0]), chain[-1][1])] != readers[(id(run), used)]:
                units.append(unit(chain))
                chain = []
            chain.append((run, used))
        if chain:
            units.append(unit(chain))
        out.append(units)
    return out


def _reads(spans: list[tuple[Runs, int, int, int, int]]) -> list[Read]:
    """Each run read by a contiguous stretch of queries as one `Read`: `spans` are (runs, lo, hi, q_min, q_max) in
    query order."""
    open_reads: dict[tuple[int, int], list] = {}
    done: list[Read] = []
    for runs, lo, hi, q_min, q_max in spans:
        for run, used in runs:
            key = (id(run), used)
            current = open_reads.get(key)
            if current is not None and current[3] == lo:
                current[3], current[4], current[5] = hi, min(current[4], q_min), max(current[5], q_max)
                continue
            if current is not None:
                done.append(Read(*current))
            open_reads[key] = [run, used, lo, hi, q_min, q_max]
    return done + [Read(*r) for r in open_reads.values()]


# ---------------------------------------------------------------------------------------------- prefill and decoding


class SharedDecoding:
    """One chunk of a `generate` call: the trie prefilled, then the rows decoded step by step over shared K/V.

    The decoding interface of treerl.rollout.sampling.embedded: `logits` (the first step's, row order), `step(token)`,
    `drop(keep)`, `call_rows` (the rows in the order the last model call ran them) and `finish(completions)`
    (what the cache keeps)."""

    def __init__(self, model: PreTrainedModel, prompts: list[list[int]], n: int, max_new_tokens: int,
                 cache: PrefixCache, mixers: Mixers, record: RouteRecord | None, counts: PrefixCounts,
                 store: bool = False, trie: tuple[list[CallNode], list[CallNode]] | None = None):
        self.model, self.prompts, self.n, self.cache, self.mixers, self.record = model, prompts, n, cache, mixers, record
        self.device = model.get_input_embeddings().weight.device
        self.store = store  # keep each finished row's K/V for the cache
        self.layers = attention_layers(model, mixers.mixer_classes)
        self.nodes, self.ends = trie or call_trie(prompts, cache, bool(mixers))  # `call_trie`, under the cache's lock
        counts.prompt_tokens += sum(len(p) for p in prompts)
        counts.prefill_tokens += sum(len(node.tokens) for node in self.nodes)
        counts.cached_tokens += _distinct_cached(self.nodes)
        self._prefill()
        self.prompt_routes = [self._prompt_routes(i) for i in range(len(prompts))] if record is not None else None
        order = sorted(range(len(prompts)), key=lambda p: self.nodes.index(self.ends[p]))  # trie order
        rows = [p * n + j for p in order for j in range(n)]
        self.call_rows = torch.tensor(rows, dtype=torch.long)  # each running row's number (prompt-major), trie order
        self.row_prompt = [r // n for r in rows]
        self.positions = torch.tensor([len(prompts[p]) for p in self.row_prompt], device=self.device)
        self.units, own = self._row_units()
        self.kv = RowKV(len(rows), max_new_tokens, own)
        self.states = self._row_states() if mixers else None
        self.finished: dict[int, tuple[KVRun, States | None]] = {}  # row -> its own K/V (and states), for the cache
        self._layout()
        hidden = torch.stack([self.ends[p].hidden for p in range(len(prompts))])
        self.logits = self._logits(hidden).repeat_interleave(n, dim=0)

    # -- prefill
    def _prefill(self) -> None:
        """Every trie node once, wave by wave (a node after its parent), several nodes packed into one call where the
        layers allow it (a hybrid's state would run on from one node into the next: one node a call)."""
        depth = max((node.depth for node in self.nodes), default=-1)
        for wave in range(depth + 1):
            batch: list[CallNode] = []
            for node in (n for n in self.nodes if n.depth == wave):
                if batch and (self.mixers or sum(len(b.tokens) for b in batch) + len(node.tokens) > PREFILL_TOKENS):
                    self._prefill_call(batch)
                    batch = []
                batch.append(node)
            if batch:
                self._prefill_call(batch)

    def _prefill_call(self, batch: list[CallNode]) -> None:
        segments, spans, ids, positions, row = [], [], [], [], 0
        for node, runs in zip(batch, _units([node.reads() for node in batch])):
            segments.append(Segment(row, len(node.tokens), node.start))
            spans.append((runs, row, row + len(node.tokens), node.start, node.end - 1))
            ids += node.tokens
            positions += range(node.start, node.end)
            row += len(node.tokens)
        positions_t = torch.tensor(positions, device=self.device)
        call = PrefixCall(_reads(spans), positions_t, segments=segments)
        cache = None
        if self.mixers:
            cache = self.mixers.new_cache(batch[0].initial_states(), 1, batch[0].start, device=self.device)
        hidden = self._forward(torch.tensor([ids], device=self.device), positions_t[None], call, cache)[0]
        routes = self.record.take(len(ids)) if self.record is not None else None
        for node, s in zip(batch, segments):
            node.kv = KVRun(node.start, s.length, {slot: k[:, :, s.row : s.end] for slot, (k, _) in call.kept.items()},
                            {slot: v[:, :, s.row : s.end] for slot, (_, v) in call.kept.items()})
            node.states = cache.row_states(0) if cache is not None else None
            node.routes = routes[s.row : s.end] if routes is not None else None
            node.hidden = hidden[s.end - 1]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, call: PrefixCall, cache) -> torch.Tensor:
        """The body's final hidden states of one call through treerl's attention (and a hybrid's states)."""
        inputs = {"input_ids": ids, "position_ids": positions, CALL_KWARG: call}
        if cache is not None:
            inputs.update({self.mixers.cache_kwarg: cache, "use_cache": True})
        with engine_attention(self.model), continued_scans(self.mixers.scans), \
                compressed_entries(self.model) if self.mixers.compression else contextlib.nullcontext():
            hidden = final_hidden(self.model, **inputs)
        if cache is not None:
            cache.finish()
            cache.check_handed_on(self.mixers.layers, [0])
        check_all_layers_routed(self.model, call.layers_called, self.layers)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return logit_transform(self.model).apply(self.model.get_output_embeddings()(hidden))

    def _prompt_routes(self, p: int) -> torch.Tensor:
        """Prompt `p`'s routes: its cached prefix's, then its trie nodes'."""
        end = self.ends[p]
        return torch.cat([*end.cached.routes, *(n.routes for n in end.path())])

    def _row_states(self) -> States:
        """Each row's states: a copy of its prompt's (the fork)."""
        ends = [self.ends[p].states for p in self.row_prompt]
        return {key: torch.cat([states[key] for states in ends]) for key in ends[0]}

    # -- decoding
    def _row_units(self) -> tuple[list[Runs], list[KVRun | None]]:
        """Each row's runs from the root (`_units`), but the end of its path that only it reads, or that few rows
        read and is short (at most COPIED_TOKENS copied tokens): its own buffer holds a copy of those instead
        (`RowKV`: one batched kernel call for every row's own stretch, not a call a run)."""
        paths = []
        for p in self.row_prompt:
            end = self.ends[p]
            paths.append([*end.reads(), (end.kv, len(end.tokens))])
        units = _units(paths)
        readers: dict[tuple[int, int], int] = {}
        for path in units:
            for run, used in path:
                readers[(id(run), used)] = readers.get((id(run), used), 0) + 1
        own: list[KVRun | None] = []
        copies: dict[tuple, KVRun] = {}  # the rows of one prompt share their tail: joined once
        for i, path in enumerate(units):
            cut = len(path)
            while cut and (readers[(id(path[cut - 1][0]), path[cut - 1][1])] - 1) * path[cut - 1][1] <= COPIED_TOKENS:
                cut -= 1
            key = tuple((id(run), used) for run, used in path[cut:])
            if key and key not in copies:
                copies[key] = joined([run.piece(run.start, run.start + used) for run, used in path[cut:]])
            own.append(copies.get(key))
            units[i] = path[:cut]
        return units, own

    def _layout(self) -> None:
        """The running rows' reads (which rows see which run) and where each row stands in row order."""
        spans = []
        for i, p in enumerate(self.row_prompt):
            spans.append((self.units[i], i, i + 1, len(self.prompts[p]), len(self.prompts[p])))
        self._spans = _reads(spans)
        self._order = torch.argsort(self.call_rows)  # row order: each row's place in the call
        self._rank = torch.argsort(self._order)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Run each running row's last token (row order); the next logits, row order."""
        t = self.kv.length
        token = token[self._rank.to(token.device)]
        positions = self.positions + t
        reads = [Read(r.run, r.used, r.lo, r.hi, r.q_min + t, r.q_max + t) for r in self._spans]
        call = PrefixCall(reads, positions, rows=self.kv)
        cache = None
        if self.mixers:
            cache = self.mixers.new_cache(self.states, len(token), int(positions.min()), device=self.device)
        hidden = self._forward(token[:, None], positions[:, None], call, cache)[:, -1]
        if cache is not None:
            self.states = {key: cache.final[key] for key in self.states}
        self.kv.length += 1
        return self._logits(hidden)[self._order.to(hidden.device)]

    def drop(self, keep: torch.Tensor) -> None:
        """Keep these rows (indices in row order among the running ones); the others have stopped."""
        kept = self._order[keep.cpu()]  # their places in the call
        if self.store:
            stopped = torch.ones(len(self.call_rows), dtype=torch.bool)
            stopped[kept] = False
            self._keep_finished(stopped.nonzero()[:, 0].tolist())
        kept = kept.sort().values  # trie order
        self.call_rows = self.call_rows[kept]
        self.row_prompt = [self.row_prompt[i] for i in kept.tolist()]
        self.units = [self.units[i] for i in kept.tolist()]
        self.positions = self.positions[kept.to(self.device)]
        self.kv.keep(kept.to(self.device))
        if self.states is not None:
            self.states = {key: s[kept.to(s.device)] for key, s in self.states.items()}
        self._layout()

    def _keep_finished(self, places: list[int]) -> None:
        for i in places:
            run = self.kv.run(i, len(self.prompts[self.row_prompt[i]]))  # views: the cache copies what it keeps
            states = {key: s[i : i + 1].clone() for key, s in self.states.items()} if self.states is not None else None
            self.finished[int(self.call_rows[i])] = (run, states)

    def finish(self, completions: list[Completion]) -> None:
        """Into the cache: each prompt, and each row's prompt and tokens (but the last, which no forward ran)."""
        if not self.store:
            return
        self._keep_finished(list(range(len(self.call_rows))))
        for p, prompt in enumerate(self.prompts):
            end = self.ends[p]
            runs = [*end.cached.reads, *((node.kv, len(node.tokens)) for node in end.path())]
            states = {node.end: node.states for node in end.path() if node.states is not None}
            routes = self.prompt_routes[p] if self.prompt_routes is not None else None
            self.cache.insert(prompt, _slicer(runs), states, _route_slicer(routes))
            for j in range(self.n):
                row = p * self.n + j
                completion = completions[row]
                own, row_states = self.finished[row]
                if own.length == 0:
                    continue
                tokens = prompt + completion.tokens[: own.length]
                more = {len(tokens): row_states} if row_states is not None else {}
                self.cache.insert(tokens, _slicer([*runs, (own, own.length)]), {**states, **more},
                                  _route_slicer(completion.routed_experts))
        self.cache.evict()


def _slicer(runs: list[tuple[KVRun, int]]):
    """`kv_of(a, b)` over consecutive runs: the K/V of positions [a, b), a copy."""
    def kv_of(a: int, b: int) -> KVRun:
        pieces = [run.piece(max(a, run.start), min(b, run.start + used)) for run, used in runs
                  if run.start < b and run.start + used > a]
        return joined(pieces)
    return kv_of


def _route_slicer(routes: torch.Tensor | None):
    return None if routes is None else (lambda a, b: routes[a:b].clone())


def _distinct_cached(nodes: list[CallNode]) -> int:
    """Distinct cached tokens the call's nodes read: each cached run counted once, as far as any node reads it."""
    most: dict[int, int] = {}
    for node in nodes:
        for run, used in node.cached.reads:
            most[id(run)] = max(most.get(id(run), 0), used)
    return sum(most.values())

