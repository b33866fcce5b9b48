"""Output heads: per-token log-probs and entropy from the LM head, computed in row chunks.

A `[tokens, vocab]` float32 logits tensor is never materialised for a long node: forward and
backward each walk the rows `chunk_rows` at a time and recompute a chunk's logits in backward
instead of saving them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """log softmax(h W^T / t)[target] and the entropy of that softmax, row chunk by row chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_rows: int):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype)
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            logits = _logits(hidden[lo:hi], weight, bias, temperature, dtype)
            lse = torch.logsumexp(logits, dim=-1)
            logprobs[lo:hi] = logits.gather(1, targets[lo:hi, None])[:, 0] - lse
            probs = torch.exp(logits - lse[:, None])
            entropy[lo:hi] = lse - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        t, chunk_rows = ctx.temperature, ctx.chunk_rows
        dtype = entropy.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        for lo in range(0, hidden.shape[0], chunk_rows):
            hi = min(lo + chunk_rows, hidden.shape[0])
            logits = _logits(hidden[lo:hi], weight, bias, t, dtype)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            probs = torch.exp(logits - lse)
            # d logp[y] / d z = onehot(y) - p ;  d H / d z = -p (z - E_p[z]),  E_p[z] = lse - H
            g_lp = grad_logprobs[lo:hi, None].to(dtype)
            g_ent = grad_entropy[lo:hi, None].to(dtype)
            grad_logits = -probs * (g_lp + g_ent * (logits - (lse - entropy[lo:hi, None])))
            grad_logits.scatter_add_(1, targets[lo:hi, None], g_lp)
            grad_logits /= t
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
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(h, weight, bias, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    logits = torch.nn.functional.linear(h, weight, bias).to(dtype)
    return logits / temperature if temperature != 1.0 else logits


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
        """Reject models whose logits are not a plain linear map of the final hidden state."""
        lm_head = model.get_output_embeddings()
        if not isinstance(lm_head, torch.nn.Linear):
            raise NotImplementedError(f"{type(model).__name__}: output embeddings are not an nn.Linear")
        if getattr(model.config, "final_logit_softcapping", None):
            raise NotImplementedError(f"{type(model).__name__}: final logit soft-capping is not supported")

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of `hidden` `[N, d]` and the token each row predicts -> `{"logprobs": [N], "entropy": [N]}`."""
        lm_head = model.get_output_embeddings()
        logprobs, entropy = _ChunkedLogprobEntropy.apply(
            hidden, lm_head.weight, lm_head.bias, targets, self.temperature, self.chunk_rows
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
            raise NotImplementedError(
                f"{type(model).__name__}: a value head needs `model.score`, an nn.Linear with one output "
                "(a *ForTokenClassification model with num_labels=1; see treerl.algo.critic.build_critic)"
            )
        dropout = getattr(model, "dropout", None)
        if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            raise NotImplementedError(
                f"{type(model).__name__}: value dropout p={dropout.p} is not applied by the engines; "
                "set config.classifier_dropout = 0"
            )

    def __call__(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows of `hidden` `[N, d]` -> `{"values": [N]}` (the targets are not read: a value has no token)."""
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        values = torch.nn.functional.linear(hidden, model.score.weight, model.score.bias)[:, 0]
        return {"values": values.to(dtype)}
