"""The embedded sampler: sampling from the trainer's own transformers model, in process.

Step 1 (docs/architecture.md): sampling in the trainer's own process.

By default every prefix shared by the prompts of a call (a system prompt, a GRPO group's prompt, an episode's history)
is computed once, and so is any prefix an earlier call computed with the same weights: the prompts form a trie over
the prefix cache, each node prefilled once, and the rows decode over one copy of each prefix's K/V
(treerl.rollout.sampling.prefix_sharing, treerl.rollout.sampling.prefix_cache). Where that cannot be exact (a model that attends in its
own code, prompts that show images) or with `prefix_sharing=False`, each prompt is prefilled whole in a left-padded
batch and its cache repeated n-fold (`PaddedDecoding`); so is a chunk whose sharing would not pay for its extra model
calls (nothing in the prefix cache to read or to keep for a later call, little shared: `prefix_sharing.pays`), where
the padded path is exact for the model (`padded_refusal`). Both decode in the same loop: one seeded draw a step over the
running rows in prompt-major order, so with a seed both sample the same tokens, their log-probs equal up to rounding.
Finished rows are dropped as they stop.

`autocast` (trainer.precision=bf16-mixed): the model computes under `torch.autocast` to that dtype,
as the trainer's engines do, so a token's behaviour log-prob and the one the loss recomputes come
from the same function (importance ratio 1 on-policy, up to kernel rounding).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from treerl.engine import autocast
from treerl.engine.base import final_hidden
from treerl.engine.head import logit_transform
from treerl.engine.images import ImageTable, body_positions, check_images, vision_family
from treerl.engine.recurrent import Mixers, cache_kwarg, find_mixers
from treerl.engine.routing import RouteRecord, recording_routes
from treerl.engine.support import decoder_module
from treerl.errors import TrainingStopped
from treerl.rollout.sampling.prefix_cache import DEFAULT_TOKENS, PrefixCache
from treerl.rollout.sampling.prefix_sharing import CallNode, PrefixCounts, SharedDecoding, call_trie, pays, refusal
from treerl.rollout.sampling.sampler import Completion, SamplingParams, check_prompts, truncate_logits
from treerl.tree import ImageSpan, TokenSequence

log = logging.getLogger("treerl.rollout")

_SAID: set[str] = set()  # reasons for the padded path already logged


class GenerationCancelled(RuntimeError):
    """`generate` stopped early because its `cancelled()` said so (a client left, a deadline, a shutdown)."""


@dataclass
class EmbeddedSampler:
    """Samples with `model` itself; runs anywhere the model runs (CPU included)."""

    model: PreTrainedModel
    version: int = 0  # policy version of the current weights; the trainer sets it after each update
    max_rows: int = 256  # sampled rows decoded at once (prompts x n); more prompts are split into chunks
    autocast: torch.dtype | None = None  # compute under torch.autocast to this dtype (bf16-mixed); None: as stored
    return_routed_experts: bool = False  # an MoE model: each completion's routing (Completion.routed_experts)
    prefix_sharing: bool | str = True  # every shared prefix computed once (treerl.rollout.sampling.prefix_sharing) where
    # that pays: a chunk that reads or keeps the prefix cache always, else where enough is shared (`pays`); "always":
    # every chunk the model allows (the benchmark's and the tests' shared path); False: each prompt prefilled whole in
    # a left-padded batch and its cache repeated n-fold (the reference the tests compare to)
    prefix_cache_tokens: int = DEFAULT_TOKENS  # K/V of computed prefixes kept across calls (0: none)
    counts: PrefixCounts = field(default_factory=PrefixCounts, init=False)

    def __post_init__(self) -> None:
        if self.prefix_sharing not in (True, False, "always"):
            raise ValueError(f"prefix_sharing must be True, False or 'always', got {self.prefix_sharing!r}")
        if self.prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (0: no cache), got {self.prefix_cache_tokens}")
        self.cache = PrefixCache(self.prefix_cache_tokens)
        self._lock = threading.Lock()  # the cache's: generate may run in several threads
        self._unread = False  # inside `unread()`
        self._mixers: Mixers | None = None  # the model's stateful mixers, found at the first shared chunk

    @contextlib.contextmanager
    def unread(self) -> Iterator[None]:
        """Calls whose K/V no later call reads (synchronous single-turn training empties the cache right after its
        one call): their last chunk puts nothing in the prefix cache (an earlier chunk still does, for the later ones),
        which would only cost host time. The same tokens are sampled."""
        self._unread = True
        try:
            yield
        finally:
            self._unread = False

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None,
                 images: list[tuple[ImageSpan, ...]] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt; log-probs are log_softmax(logits / T) of each sampled token.

        `cancelled()` is asked before every decoding step; when it says True, GenerationCancelled is raised
        (what a server uses to free the model for the next request). `images`: each prompt's images (placeholder
        tokens in the prompt, as `treerl.tree.ImageSpan`), for a vision-language model treerl feeds
        (treerl.engine.images): through its vision tower, at its multimodal positions, as the engines train them."""
        check_prompts(prompts, self.model.get_input_embeddings().num_embeddings)
        if images is not None:
            if len(images) != len(prompts):
                raise ValueError(f"generate: {len(images)} image lists for {len(prompts)} prompts")
            check_images(self.model, [TokenSequence(torch.tensor(p), images=tuple(i)) for p, i in zip(prompts, images)])
        device = self.model.get_input_embeddings().weight.device
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(2**62, ()).item()))
        per_chunk = max(1, self.max_rows // params.n)
        was_training = self.model.training
        self.model.eval()
        try:
            shown = images if images is not None and any(images) else None
            shared = self._shares(shown)
            results: list[list[Completion]] = []
            with autocast(self.model, self.autocast):
                for lo in range(0, len(prompts), per_chunk):
                    chunk = prompts[lo : lo + per_chunk]
                    chunk_images = shown[lo : lo + per_chunk] if shown is not None else None
                    store = not (self._unread and lo + per_chunk >= len(prompts))
                    results.extend(self._generate(chunk, params, generator, cancelled, chunk_images, shared, store))
            return results
        finally:
            self.model.train(was_training)

    def _shares(self, images: list[tuple[ImageSpan, ...]] | None) -> bool:
        """Whether this call computes shared prefixes once (else the padded path, counted, its reason logged once)."""
        if not self.prefix_sharing:
            return False
        why = "prompts show images" if images is not None else refusal(self.model)
        if why is not None:
            self.counts.unshared_calls += 1
            if why not in _SAID:
                _SAID.add(why)
                log.warning("the embedded sampler prefills each prompt whole (no prefix sharing): %s", why)
            return False
        with self._lock:
            self.cache.sync(self._weights_key())
        return True

    def _padded_instead(self, prompts: list[list[int]], nodes: list[CallNode], store: bool) -> bool:
        """Whether a chunk that could share goes the padded way (counted): sharing where it pays (True), the prefix
        cache neither read (no prompt's prefix cached) nor kept for a later call, `pays` says no, and the padded path
        is exact for the model."""
        if self.prefix_sharing == "always" or store or any(node.cached.depth for node in nodes):
            return False
        if pays(self.model, prompts, nodes) or padded_refusal(self.model) is not None:
            return False
        self.counts.padded_chunks += 1
        self.counts.prompt_tokens += sum(len(p) for p in prompts)
        self.counts.prefill_tokens += sum(len(p) for p in prompts)  # each prompt whole
        return True

    def _weights_key(self) -> tuple:
        """What the cache's K/V were computed with: the policy version, every parameter's identity and in-place
        version counter (an update the version does not announce still empties it), the autocast dtype and whether
        routes are recorded."""
        params = tuple((p.data_ptr(), p._version) for p in self.model.parameters())
        return self.version, hash(params), self.autocast, self.return_routed_experts

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
                  cancelled: Callable[[], bool] | None, images: list[tuple[ImageSpan, ...]] | None,
                  shared: bool, store: bool = True) -> list[list[Completion]]:
        """One chunk: prefill, then decode until every row stops (the prefix cache keeps its K/V if `store`)."""
        model = self.model
        if shared:  # decided before routes are recorded: the padded path's probe runs the model once per model
            if self._mixers is None:  # once: the sampler's model keeps its layers
                self._mixers = find_mixers(model)
            mixers, store = self._mixers, store and self.cache.max_tokens > 0
            with self._lock:
                key, trie = self.cache.key, call_trie(prompts, self.cache, bool(mixers))
            shared = not self._padded_instead(prompts, trie[0], store)
        with recording_routes(model) if self.return_routed_experts else contextlib.nullcontext() as record:
            if shared:
                decoding = SharedDecoding(model, prompts, params.n, params.max_new_tokens, self.cache, mixers, record,
                                          self.counts, store=store, trie=trie)
            else:
                decoding = PaddedDecoding(model, prompts, params.n, generator.device, images, record)
            completions = self._decode(decoding, len(prompts), params, generator, cancelled, record)
        if shared:
            with self._lock:
                if self.cache.key == key:  # the weights did not change meanwhile
                    decoding.finish(completions)
        return [completions[p * params.n : (p + 1) * params.n] for p in range(len(prompts))]

    def _decode(self, decoding: Decoding, prompts: int, params: SamplingParams, generator: torch.Generator,
                cancelled: Callable[[], bool] | None, record: RouteRecord | None) -> list[Completion]:
        """The decoding steps, the same whatever prefilled: one seeded draw a step over the running rows in row order
        (prompt-major, n rows a prompt); finished rows dropped. With `record`, the experts each call routed every row
        to."""
        n = params.n
        device = generator.device
        routes = _RowRoutes(decoding.prompt_routes, n) if record is not None else None
        logits = decoding.logits
        active = torch.arange(prompts * n, device=device)  # which output row each running row is
        stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        tokens: list[list[int]] = [[] for _ in range(prompts * n)]
        logprobs: list[list[float]] = [[] for _ in range(prompts * n)]
        finish: list[str] = ["length"] * (prompts * n)

        for step in range(params.max_new_tokens):
            if cancelled is not None and cancelled():
                raise GenerationCancelled(f"generation cancelled after {step} of {params.max_new_tokens} tokens")
            token, logprob = sample(logits, params, generator)
            stopped = torch.isin(token, stop)
            for row, t, lp, s in zip(active.tolist(), token.tolist(), logprob.tolist(), stopped.tolist()):
                tokens[row].append(t)
                logprobs[row].append(lp)
                if s:
                    finish[row] = "stop"
            if step == params.max_new_tokens - 1 or bool(stopped.all()):
                break
            if bool(stopped.any()):  # drop finished rows
                keep = (~stopped).nonzero().squeeze(1)
                decoding.drop(keep)
                active, token = active[keep], token[keep]
            logits = decoding.step(token)
            if routes is not None and record is not None:
                routes.step(decoding.call_rows, record)

        return [
            Completion(tokens[r], logprobs[r], finish[r], [self.version] * len(tokens[r]),  # type: ignore[arg-type]
                       routed_experts=routes.of(r) if routes is not None else None)
            for r in range(prompts * n)
        ]


class Decoding(Protocol):
    """How a chunk's rows are prefilled and stepped (`PaddedDecoding`, or treerl.rollout.sampling.prefix_sharing's)."""

    logits: torch.Tensor  # the first step's logits, [rows, vocab] in row order
    prompt_routes: list[torch.Tensor] | None  # each prompt's routes, when recorded
    call_rows: torch.Tensor  # the running rows, in the order the last model call ran them

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Run each running row's last token (row order); the next logits (row order)."""
        ...

    def drop(self, keep: torch.Tensor) -> None:
        """Only these running rows (indices in row order) go on."""
        ...


class PaddedDecoding:
    """The prompts left-padded into one batch and prefilled whole, the cache repeated n-fold (every row reads its own
    copy of its prompt's K/V), rows dropped from the cache as they stop: what the sampler does where it cannot share
    prefixes, and the reference its shared path is tested against. A prompt may show images: they go through the
    vision tower once, and every token sits at the multimodal position the engines train it at."""

    def __init__(self, model: PreTrainedModel, prompts: list[list[int]], n: int, device: torch.device,
                 images: list[tuple[ImageSpan, ...]] | None, record: RouteRecord | None):
        self.model = model
        logits, self.cache, mask, next_position = self._prefill(prompts, device, images)
        self.prompt_routes = _padded_routes(record, prompts) if record is not None else None
        # n rows per prompt; reorder_cache serves every layer kind (recurrent layers have no batch_repeat_interleave)
        self.cache.reorder_cache(torch.arange(len(prompts), device=device).repeat_interleave(n))
        self.logits = logits.repeat_interleave(n, dim=0)
        self.mask = mask.repeat_interleave(n, dim=0)
        self.next_position = next_position.repeat_interleave(n, dim=-1)
        self.call_rows = torch.arange(len(prompts) * n)

    def drop(self, keep: torch.Tensor) -> None:
        self.cache.reorder_cache(keep)  # recurrent layers too (they have no batch_select_indices)
        self.mask, self.next_position = self.mask[keep], self.next_position[:, keep]
        self.call_rows = self.call_rows[keep.cpu()]

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(token), 1)], dim=1)
        out = self.model(input_ids=token[:, None], attention_mask=self.mask, use_cache=True,
                         **{cache_kwarg(self.model): self.cache},
                         position_ids=body_positions(self.next_position, token[:, None].shape))
        self.next_position = self.next_position + 1
        return out.logits[:, -1]

    def _prefill(self, prompts: list[list[int]], device: torch.device, images: list[tuple[ImageSpan, ...]] | None
                 ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """The prompts left-padded into one batch and run once: each row's last logits, the KV cache, the
        attention mask and each row's next position (`[position rows, prompts]`: the depth, or with images the
        depth and the multimodal rotary positions)."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        inputs = {"input_ids": ids.to(device)}
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[None]
        if images is not None:  # the images through the vision tower once; each prompt at its own positions
            sequences = [TokenSequence(torch.tensor(p), images=tuple(i)) for p, i in zip(prompts, images)]
            table = ImageTable(self.model, sequences, grad=False)
            spans = [table.span(sequence, 0, len(sequence)) for sequence in sequences]
            rows = torch.full((len(prompts), width), -1, dtype=torch.long)
            positions = positions.expand(len(spans[0][0]), -1, -1).clone()
            for row, (where, shown) in enumerate(spans):
                rows[row, width - len(shown) :] = shown
                positions[:, row, width - len(shown) :] = where
        mask, positions = mask.to(device), positions.to(device)
        cache = DynamicCache(config=self.model.config)
        where = body_positions(positions, mask.shape)
        if images is None:
            out = self.model(**inputs, attention_mask=mask, position_ids=where, use_cache=True, logits_to_keep=1,
                             **{cache_kwarg(self.model): cache})
            return out.logits[:, -1], cache, mask, positions[:, :, -1] + 1
        # the text body on the image rows, as the engines run it (the full model would compute its own positions)
        body = {**table.inputs(self.model, inputs["input_ids"], rows.to(device)), "attention_mask": mask,
                "position_ids": where, "use_cache": True, cache_kwarg(decoder_module(self.model)): cache}
        family = vision_family(self.model)
        if family.both_ways:  # an image's tokens see each other both ways (Gemma 3): the model's own masks
            body["attention_mask"] = family.body_mask(self.model, (rows >= 0).long().to(device), body["inputs_embeds"],
                                                      where, padding=mask, cache=cache)
        hidden = final_hidden(self.model, **body)[:, -1]
        logits = logit_transform(self.model).apply(self.model.get_output_embeddings()(hidden))
        return logits, cache, mask, positions[:, :, -1] + 1


_PADDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> None, or why its padded path is not exact
WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                 "local_attention_window_len", "attention_chunk_size")  # a config's windows, when set


def padded_refusal(model: PreTrainedModel) -> str | None:
    """Why the padded path may not stand in for a shared one with `model` (None: it is exact). Its left padding runs
    into a recurrent state (Mamba: log-probs off by ~1.6) and can leave a windowed layer's padded rows without a key
    (Gemma 2: NaN), so any mixer or window refuses it; else a probe, once per model: prompts of 6 and 2 tokens, two
    decoding steps, against the model's own forward on each alone."""
    if model not in _PADDED:
        _PADDED[model] = _padded_refusal(model)
    return _PADDED[model]


def _padded_refusal(model: PreTrainedModel) -> str | None:
    config = model.config.get_text_config()
    windows = [f for f in WINDOW_FIELDS if getattr(config, f, None)]
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    if find_mixers(model) or windows or kinds:
        return f"{type(model).__name__}: left padding is not exact with recurrent or windowed layers"
    try:
        return _padded_probe(model)
    except Exception as e:  # noqa: BLE001 - a padded path that fails the probe is never chosen
        return f"{type(model).__name__}: the padded probe failed ({type(e).__name__}: {e})"


@torch.inference_mode()
def _padded_probe(model: PreTrainedModel) -> str | None:
    device = model.get_input_embeddings().weight.device
    vocab = model.get_input_embeddings().num_embeddings
    ids = ((torch.arange(10) * 7 + vocab // 3) % vocab).tolist()
    prompts, fed = [ids[:6], ids[6:8]], torch.tensor([ids[8:10], ids[8:10]], device=device)
    with torch.autocast(device.type, enabled=False):
        decoding = PaddedDecoding(model, prompts, 1, device, None, None)
        got = torch.stack([decoding.logits, decoding.step(fed[:, 0]), decoding.step(fed[:, 1])], dim=1).double()
        own = torch.stack([model(input_ids=torch.tensor([p + ids[8:10]], device=device)).logits[0, -3:]
                           for p in prompts]).double()
    off = float((got - own).abs().max()) / float(own.abs().max().clamp_min(1e-30))
    tolerance = 1e-3 if next(model.parameters()).element_size() >= 4 else 5e-2
    return None if off <= tolerance else f"{type(model).__name__}: the padded path is off its own forward by {off:.2g}"


class _RowRoutes:
    """Each sampled row's routing, call by call: its prompt's (from the prefill), then one row a decoding step; the
    last sampled token, which no call runs, gets -1."""

    def __init__(self, prompt: list[torch.Tensor], n: int):
        self.prompt, self.n = prompt, n
        self.steps: list[list[torch.Tensor]] = [[] for _ in range(len(prompt) * n)]

    def step(self, rows: torch.Tensor, record: RouteRecord) -> None:
        """A decoding call on these rows (in the order it ran them), one token each."""
        for row, routes in zip(rows.tolist(), record.take(len(rows))):
            self.steps[row].append(routes)

    def of(self, row: int) -> torch.Tensor:
        """Row `row`'s routes, [prompt + generated tokens, decoder layers, top_k]."""
        prompt = self.prompt[row // self.n]
        return torch.cat([prompt, *(s[None] for s in self.steps[row]), prompt.new_full((1, *prompt.shape[1:]), -1)])


def _padded_routes(record: RouteRecord, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's routes from the padded prefill (its left padding dropped)."""
    width = max(len(p) for p in prompts)
    prefill = record.take(len(prompts) * width).view(len(prompts), width, *record.shape)
    return [prefill[p, width - len(prompt) :] for p, prompt in enumerate(prompts)]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), cut as `params` says (`truncate_logits`), and its log-prob under
    the distribution it was drawn from (the behaviour log-prob; see treerl.rollout.sampling.sampler).

    Logits are promoted to at least float32 before the temperature, as `PolicyHead` does.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    tempered = logits.to(dtype) / params.temperature
    if params.truncates:
        tempered = truncate_logits(tempered, params.top_p, params.top_k, params.min_p)
    logprobs = torch.log_softmax(tempered, dim=-1)
    try:
        token = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(1)
    except RuntimeError:
        if bool(torch.isfinite(logits).all()):
            raise
        raise TrainingStopped("the policy's logits are NaN or inf while sampling: its weights are no longer finite "
                              "(e.g. after too large a trainer.lr); nothing more is sampled or written") from None
    return token, logprobs.gather(-1, token[:, None]).squeeze(1)
