"""Output heads: per-token log-probs and entropy from the LM head, computed in row chunks.

A `[tokens, vocab]` float32 logits tensor is never materialised for a long node: forward and
backward each walk the rows `chunk_rows` at a time and recompute a chunk's logits in backward
instead of saving them.

The logits are the model's own: some architectures scale the LM head's output (Cohere, Granite,
MiniCPM, Falcon-H1) or soft-cap it (Gemma-2/3). `logit_transform` reads that from the config and
checks it once per model against the model's own forward; a model whose logits are something
else is refused, so every engine's log-probs equal the model's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treerl.attention import UnsupportedModel
from treerl.engine.support import decoder_module, dict_outputs, last_hidden


@dataclass(frozen=True)
class LogitTransform:
    """logits = softcap * tanh(scale * lm_head(hidden) / softcap)  (no soft-cap: scale * lm_head(hidden))."""

    scale: float = 1.0
    softcap: float | None = None

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        logits = raw * self.scale if self.scale != 1.0 else raw
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def derivative(self, raw: torch.Tensor) -> torch.Tensor | float:
        """d logits / d raw, elementwise."""
        if not self.softcap:
            return self.scale
        return self.scale * (1 - torch.tanh(raw * self.scale / self.softcap) ** 2)


# config key -> how it enters the logits: multiply or divide the LM head's output (MiniCPM3 and Inkling
# divide the hidden state before a bias-free head instead: the same logits)
_SCALES = {"logit_scale": "multiply", "lm_head_multiplier": "multiply", "logits_scaling": "divide",
           "logits_mup_width_multiplier": "divide"}
_VERIFIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> transforms checked against it


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest value (infinite if the shapes differ)."""
    if a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) / max(1.0, float(b.double().abs().max()))


def logit_transform(model: PreTrainedModel) -> LogitTransform:
    """The model's logits as a function of its LM head's output, from the config keys treerl knows."""
    config = model.config.get_text_config()
    scale = 1.0
    for key, how in _SCALES.items():
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 1:
            scale = scale * value if how == "multiply" else scale / value
    softcap = getattr(config, "final_logit_softcapping", None) or None
    return LogitTransform(float(scale), float(softcap) if softcap else None)


@torch.no_grad()
def verify_logit_transform(model: PreTrainedModel, transform: LogitTransform) -> None:
    """Once per model: its own logits on a few tokens must be the transform of its LM head applied to the body's output.

    Catches what no config key says: a transform between the body and the LM head (BERT/RoBERTa
    heads), logits from another stream (ProphetNet), several heads (MusicGen), an unknown scale.
    """
    if transform in _VERIFIED.get(model, ()):
        return
    lm_head = model.get_output_embeddings()
    seen: dict[str, torch.Tensor] = {}
    hook = decoder_module(model).register_forward_hook(lambda m, a, out: seen.update(hidden=last_hidden(out)))
    try:
        vocab = model.get_input_embeddings().num_embeddings
        ids = (torch.arange(4) + vocab // 3).clamp(max=vocab - 1)[None]  # ordinary ids: specials sit at the ends
        with dict_outputs(model):
            output = model(input_ids=ids.to(lm_head.weight.device), use_cache=False)
    except Exception as error:  # the model's own forward on four tokens: anything but success is a refusal
        raise UnsupportedModel(
            f"{type(model).__name__}: its own forward failed on a four-token probe ({type(error).__name__}: {error})"
        ) from error
    finally:
        hook.remove()
    logits = output.logits if hasattr(output, "logits") else output[0]
    hidden = seen.get("hidden")
    readable = hidden is not None and hidden.shape[-1] == lm_head.in_features  # else the head reads something else
    ours = transform.apply(lm_head(hidden).to(logits.dtype)) if readable else None
    tolerance = {16: 1e-2, 32: 1e-5}.get(torch.finfo(logits.dtype).bits, 1e-10)
    error = _relative(ours, logits) if ours is not None else float("inf")
    if not error <= tolerance:
        raise UnsupportedModel(
            f"{type(model).__name__}: its logits are not {transform} of get_output_embeddings() applied to the "
            f"body's final hidden state (off by {error:.3g}: a transform between them, another output stream, "
            "or a scale treerl does not know); treerl cannot reproduce its log-probs"
        )
    _VERIFIED.setdefault(model, set()).add(transform)


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """log softmax(f(h W^T + b) / t)[target] and the entropy of that softmax, row chunk by row chunk (f: the model's logit transform)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform: LogitTransform, temperature: float, chunk_rows: int):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype)
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            logits, _ = _logits(hidden[lo:hi], weight, bias, transform, temperature, dtype)
            lse = torch.logsumexp(logits, dim=-1)
            logprobs[lo:hi] = logits.gather(1, targets[lo:hi, None])[:, 0] - lse
            probs = torch.exp(logits - lse[:, None])
            entropy[lo:hi] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.transform, ctx.temperature, ctx.chunk_rows = transform, temperature, chunk_rows
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        transform, t, chunk_rows = ctx.transform, ctx.temperature, ctx.chunk_rows
        dtype = entropy.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        for lo in range(0, hidden.shape[0], chunk_rows):
            hi = min(lo + chunk_rows, hidden.shape[0])
            logits, slope = _logits(hidden[lo:hi], weight, bias, transform, t, dtype)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            probs = torch.exp(logits - lse)
            # d logp[y] / d z = onehot(y) - p ;  d H / d z = -p (z - E_p[z]),  E_p[z] = lse - H
            g_lp = grad_logprobs[lo:hi, None].to(dtype)
            g_ent = grad_entropy[lo:hi, None].to(dtype)
            grad_logits = -probs * (g_lp + g_ent * (logits - (lse - entropy[lo:hi, None])))
            grad_logits.scatter_add_(1, targets[lo:hi, None], g_lp)
            grad_logits *= slope  # through the temperature and the model's logit scale / soft-cap
            h = hidden[lo:hi].to(dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = (grad_logits @ weight.to(dtype)).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _logits(h, weight, bias, transform: LogitTransform, temperature: float, dtype: torch.dtype):
    """The sampled distribution's logits for rows `h`, and d logits / d (h W^T + b) (scalar or per element)."""
    raw = torch.nn.functional.linear(h, weight, bias).to(dtype)
    logits = transform.apply(raw)
    slope = transform.derivative(raw)
    if temperature != 1.0:
        logits, slope = logits / temperature, slope / temperature
    return logits, slope


@dataclass
class PolicyHead:
    """The policy's per-token outputs: log-prob of each token given its prefix, and the entropy there.

    `shifted`: the output for token j comes from the hidden state at position j - 1 (for a node's
    first token, from its parent's last position: the fork logits).
    """

    temperature: float = 1.0
    chunk_rows: int = 1024
    outputs: tuple[str, ...] = ("logprobs", "entropy")
    shifted: bool = True

    def check(self, model: PreTrainedModel) -> None:
        """Reject models whose logits are not a known function of a linear map of the final hidden state."""
        lm_head = model.get_output_embeddings()
        if not isinstance(lm_head, torch.nn.Linear):
            raise UnsupportedModel(f"{type(model).__name__}: output embeddings are not an nn.Linear")
        verify_logit_transform(model, logit_transform(model))

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of `hidden` `[N, d]` and the token each row predicts -> `{"logprobs": [N], "entropy": [N]}`."""
        lm_head = model.get_output_embeddings()
        logprobs, entropy = _ChunkedLogprobEntropy.apply(
            hidden, lm_head.weight, lm_head.bias, targets, logit_transform(model), self.temperature, self.chunk_rows
        )
        return {"logprobs": logprobs, "entropy": entropy}


@dataclass
class ValueHead:
    """A critic's per-token values: its scalar `score` layer applied to the final hidden states.

    The critic is a transformers `*ForTokenClassification` model with one label (see
    `treerl.algo.critic.build_critic`): `model.base_model` is the decoder, `model.score` the value layer.
    `shifted=True` (default): `values[j]` comes from the hidden state at j - 1, i.e. it is V(tokens[:j]),
    the value of the state in which token j was chosen, aligned with `logprobs[j]`; position 0 holds 0.
    `shifted=False`: `values[j]` = V(tokens[:j+1]), from the hidden state at j.
    """

    outputs: tuple[str, ...] = ("values",)
    shifted: bool = True

    def check(self, model: PreTrainedModel) -> None:
        """Reject models without a one-output linear `score`, or with dropout the engines would not apply."""
        score = getattr(model, "score", None)
        if not isinstance(score, torch.nn.Linear) or score.out_features != 1:
            raise UnsupportedModel(
                f"{type(model).__name__}: a value head needs `model.score`, an nn.Linear with one output "
                "(a *ForTokenClassification model with num_labels=1; see treerl.algo.critic.build_critic)"
            )
        dropout = getattr(model, "dropout", None)
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            raise UnsupportedModel(
                f"{type(model).__name__}: value dropout p={dropout.p} is not applied by the engines; "
                "set config.classifier_dropout = 0"
            )

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of `hidden` `[N, d]` -> `{"values": [N]}` (the targets are not read: a value has no token)."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        values = torch.nn.functional.linear(hidden, model.score.weight, model.score.bias)[:, 0]
        return {"values": values.to(dtype)}
