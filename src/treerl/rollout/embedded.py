"""The embedded sampler: sampling from the trainer's own transformers model, in process.

Step 1 (docs/architecture.md): sampling in the trainer's own process.

Each distinct prompt is prefilled once; its KV cache is then repeated `n` times and the `n`
samples decode together, so the prompt of a GRPO group is computed once, not `n` times. Prompts
are left-padded into one batch; finished rows are dropped from the cache as they stop. A prompt may show images
(a vision-language model treerl feeds): they go through the vision tower once, and every token sits at the multimodal
position the engines train it at (treerl.engine.images).

`autocast` (trainer.precision=bf16-mixed): the model computes under `torch.autocast` to that dtype,
as the trainer's engines do, so a token's behaviour log-prob and the one the loss recomputes come
from the same function (importance ratio 1 on-policy, up to kernel rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from treerl.engine import autocast
from treerl.engine.base import final_hidden
from treerl.engine.head import logit_transform
from treerl.engine.images import ImageTable, body_positions, check_images, vision_family
from treerl.engine.recurrent import cache_kwarg
from treerl.engine.routing import RouteRecord, recording_routes
from treerl.engine.support import decoder_module
from treerl.errors import TrainingStopped
from treerl.rollout.sampler import Completion, SamplingParams, check_prompts, truncate_logits
from treerl.tree import ImageSpan, TokenSequence


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
            results: list[list[Completion]] = []
            with autocast(self.model, self.autocast):
                for lo in range(0, len(prompts), per_chunk):
                    shown = images[lo : lo + per_chunk] if images is not None and any(images) else None
                    results.extend(self._generate(prompts[lo : lo + per_chunk], params, generator, cancelled, shown))
            return results
        finally:
            self.model.train(was_training)

    @torch.inference_mode()
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

    @torch.inference_mode()
    def _generate(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
        cancelled: Callable[[], bool] | None = None, images: list[tuple[ImageSpan, ...]] | None = None,
    ) -> list[list[Completion]]:
        """Prefill the distinct prompts, repeat their cache n-fold, decode until every row stops."""
        model = self.model
        with recording_routes(model) if self.return_routed_experts else contextlib.nullcontext() as record:
            return self._decode(prompts, params, generator, cancelled, images, record)

    def _decode(self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator,
                cancelled: Callable[[], bool] | None, images: list[tuple[ImageSpan, ...]] | None,
                record: RouteRecord | None) -> list[list[Completion]]:
        """`_generate`'s prefill and decoding steps; with `record`, the experts each call routed every row to."""
        model, n = self.model, params.n
        device = generator.device
        logits, cache, mask, next_position = self._prefill(prompts, device, images)
        routes = _RowRoutes(record, prompts, n) if record is not None else None
        # n rows per prompt; reorder_cache serves every layer kind (recurrent layers have no batch_repeat_interleave)
        cache.reorder_cache(torch.arange(len(prompts), device=device).repeat_interleave(n))
        logits = logits.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        next_position = next_position.repeat_interleave(n, dim=-1)
        active = torch.arange(len(prompts) * n, device=device)  # which output row each cache row is
        stop = torch.tensor(sorted(params.stop_token_ids), dtype=torch.long, device=device)
        tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        logprobs: list[list[float]] = [[] for _ in range(len(prompts) * n)]
        finish: list[str] = ["length"] * (len(prompts) * n)

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
            if bool(stopped.any()):  # drop finished rows from the cache
                keep = (~stopped).nonzero().squeeze(1)
                cache.reorder_cache(keep)  # recurrent layers too (they have no batch_select_indices)
                active, token, mask, next_position = active[keep], token[keep], mask[keep], next_position[:, keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache},
                        position_ids=body_positions(next_position, token[:, None].shape))
            if routes is not None:
                routes.step(active)
            logits = out.logits[:, -1]
            next_position = next_position + 1

        completions = [
            Completion(tokens[r], logprobs[r], finish[r], [self.version] * len(tokens[r]),  # type: ignore[arg-type]
                       routed_experts=routes.of(r) if routes is not None else None)
            for r in range(len(prompts) * n)
        ]
        return [completions[p * n : (p + 1) * n] for p in range(len(prompts))]


class _RowRoutes:
    """Each sampled row's routing, call by call: its prompt's rows of the prefill (left padding dropped), then one
    row a decoding step; the last sampled token, which no call runs, gets -1."""

    def __init__(self, record: RouteRecord, prompts: list[list[int]], n: int):
        self.record, self.n = record, n
        width = max(len(p) for p in prompts)
        prefill = record.take(len(prompts) * width).view(len(prompts), width, *record.shape)
        self.prompt = [prefill[p, width - len(prompt) :] for p, prompt in enumerate(prompts)]
        self.steps: list[list[torch.Tensor]] = [[] for _ in range(len(prompts) * n)]

    def step(self, active: torch.Tensor) -> None:
        """A decoding call on the `active` rows, one token each."""
        for row, routes in zip(active.tolist(), self.record.take(len(active))):
            self.steps[row].append(routes)

    def of(self, row: int) -> torch.Tensor:
        """Row `row`'s routes, [prompt + generated tokens, decoder layers, top_k]."""
        prompt = self.prompt[row // self.n]
        return torch.cat([prompt, *(s[None] for s in self.steps[row]), prompt.new_full((1, *prompt.shape[1:]), -1)])


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(logits / T), cut as `params` says (`truncate_logits`), and its log-prob under
    the distribution it was drawn from (the behaviour log-prob; see treerl.rollout.sampler).

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
