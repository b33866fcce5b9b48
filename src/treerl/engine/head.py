"""Output heads: per-token log-probs and entropy from the LM head, computed in row chunks.

Step 5 (docs/architecture.md): final hidden states to each token's log-prob and entropy.

A `[tokens, vocab]` float32 logits tensor is never materialised for a long node: forward and
backward each walk the rows `chunk_rows` at a time and recompute a chunk's logits in backward
instead of saving them.

The logits are the model's own: some architectures scale the LM head's output (Cohere, Granite,
MiniCPM, Falcon-H1) or soft-cap it (Gemma-2/3). `logit_transform` reads that from the config and
checks it once per model against the model's own forward; a model whose logits are something
else is refused, so every engine's log-probs equal the model's.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from torch.autograd.graph import get_gradient_edge
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
    # a head kept in float32 (HY-V4's, `_keep_in_fp32_modules_strict`) reads the hidden state in its own dtype
    ours = transform.apply(lm_head(hidden.to(lm_head.weight.dtype)).to(logits.dtype)) if readable else None
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
    """log softmax(f(h W^T + b) / t)[target] and the entropy of that softmax, row chunk by row chunk (f: the model's logit transform).

    Matmuls run in the compute dtype (autocast's where it is on, as the model's own LM head would
    under it; else the weight's), the softmax and everything after it in at least float32. The
    weight is cast to the compute dtype at most once per call, never per chunk. The weight's
    gradient is accumulated chunk by chunk with `addmm_`: straight into `weight.grad` when autograd
    would only add it there (`in_place`, see `_grad_target`), so a call allocates no
    `[vocab, hidden]` buffer at all; otherwise into one buffer that is returned.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform: LogitTransform, temperature: float, chunk_rows: int,
                in_place: bool = False, known: tuple[torch.Tensor, torch.Tensor] | None = None):
        compute = compute_dtype(weight)
        dtype = torch.promote_types(compute, torch.float32)
        if known is not None:  # a recomputation whose outputs were computed before: only the backward is needed
            logprobs, entropy = (x.to(dtype=dtype, copy=True) for x in known)
        else:
            logprobs, entropy = _logprobs_entropy(hidden, weight, bias, targets, transform, temperature, chunk_rows)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.transform, ctx.temperature, ctx.chunk_rows, ctx.compute, ctx.in_place = (
            transform, temperature, chunk_rows, compute, in_place)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        transform, t, chunk_rows, compute = ctx.transform, ctx.temperature, ctx.chunk_rows, ctx.compute
        dtype = entropy.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        target = _grad_target(weight) if ctx.needs_input_grad[1] and ctx.in_place else None
        grad_weight = None
        if ctx.needs_input_grad[1] and target is None:
            grad_weight = target = torch.zeros_like(weight)
        grad_bias = torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        lock = GRAD_LOCK if target is not None and grad_weight is None else contextlib.nullcontext()
        with _no_autocast(hidden):
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for lo in range(0, hidden.shape[0], chunk_rows):
                hi = min(lo + chunk_rows, hidden.shape[0])
                h = hidden[lo:hi].to(compute)
                logits, slope = _logits(h, w, b, transform, t, dtype)
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                probs = torch.exp(logits - lse)
                # d logp[y] / d z = onehot(y) - p ;  d H / d z = -p (z - E_p[z]),  E_p[z] = lse - H
                g_lp = grad_logprobs[lo:hi, None].to(dtype)
                g_ent = grad_entropy[lo:hi, None].to(dtype)
                grad_logits = -probs * (g_lp + g_ent * (logits - (lse - entropy[lo:hi, None])))
                grad_logits.scatter_add_(1, targets[lo:hi, None], g_lp)
                grad_logits *= slope  # through the temperature and the model's logit scale / soft-cap
                if grad_hidden is not None:
                    grad_hidden[lo:hi] = (grad_logits.to(compute) @ w).to(hidden.dtype)
                if target is not None:
                    with lock:
                        _add_product(target, grad_logits, h)
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _logprobs_entropy(hidden, weight, bias, targets, transform: LogitTransform, temperature: float, chunk_rows: int):
    """The forward values of `_ChunkedLogprobEntropy`, chunk by chunk, without a graph."""
    compute = compute_dtype(weight)
    dtype = torch.promote_types(compute, torch.float32)
    n = hidden.shape[0]
    logprobs = hidden.new_empty(n, dtype=dtype)
    entropy = hidden.new_empty(n, dtype=dtype)
    with _no_autocast(hidden):
        w, b = weight.to(compute), None if bias is None else bias.to(compute)
        for lo in range(0, n, chunk_rows):
            hi = min(lo + chunk_rows, n)
            logits, _ = _logits(hidden[lo:hi].to(compute), w, b, transform, temperature, dtype)
            lse = torch.logsumexp(logits, dim=-1)
            logprobs[lo:hi] = logits.gather(1, targets[lo:hi, None])[:, 0] - lse
            probs = torch.exp(logits - lse[:, None])
            entropy[lo:hi] = lse - (probs * logits).sum(-1)
    return logprobs, entropy


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's matmuls run in: autocast's where it is on for the weight's device, else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _no_autocast(x: torch.Tensor):
    """The head casts explicitly: autocast would otherwise also recast its float32 softmax math."""
    return torch.autocast(x.device.type, enabled=False)


GRAD_LOCK = threading.Lock()  # in-place accumulation into a .grad from several threads' backward passes (head, embedding)


def _grad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight.grad` (created as zeros if None) when this backward would only add the weight's gradient to it.

    That holds for a plain `.backward()` reaching a leaf with no hooks on it (engines call
    `.backward()`); not under `torch.autograd.grad`, with `inputs=` that leave the weight out, or
    when a hook would see or change the gradient: then the gradient is returned to autograd.
    """
    if not weight.is_leaf or weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None
    if torch.is_grad_enabled() or weight.grad is not None and (weight.grad.dtype != weight.dtype or weight.grad.is_sparse):
        return None
    try:
        accumulates = torch._C._will_engine_execute_node(get_gradient_edge(weight).node)
    except RuntimeError:  # "... currently running autograd.grad()": the gradient is returned, not accumulated
        return None
    if not accumulates:
        return None
    with GRAD_LOCK:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
    return weight.grad


def _add_product(target: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    """target += grad_logits^T h: operands in h's (compute) dtype, sums in target's.

    bf16-mixed (float32 gradient, bfloat16 compute): on CUDA one bfloat16 GEMM accumulating into the
    float32 gradient (`out_dtype`); CPU has no such GEMM, so the float32 logits gradient and the
    hidden states widened to float32 are multiplied instead (more exact, never less).
    """
    if target.dtype == h.dtype:
        target.addmm_(grad_logits.to(h.dtype).T, h)
    elif target.is_cuda and _mixed_gemm(target.device):  # taken on an H100 (test_cuda.py, gpu)
        torch.addmm(target, grad_logits.to(h.dtype).T, h, out_dtype=target.dtype, out=target)
    else:
        target.addmm_(grad_logits.to(target.dtype).T, h.to(target.dtype))


@functools.cache
def _mixed_gemm(device: torch.device) -> bool:
    """Whether this device's PyTorch has the bfloat16 -> float32 accumulating GEMM (`addmm(..., out_dtype=)`)."""
    out = torch.zeros(2, 2, device=device)
    try:
        torch.addmm(out, torch.ones(2, 2, device=device, dtype=torch.bfloat16),
                    torch.ones(2, 2, device=device, dtype=torch.bfloat16), out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((out == 2).all())


def _logits(h, weight, bias, transform: LogitTransform, temperature: float, dtype: torch.dtype):
    """The sampled distribution's logits for rows `h`, and d logits / d (h W^T + b) (scalar or per element)."""
    raw = torch.nn.functional.linear(h, weight, bias).to(dtype)
    logits = transform.apply(raw)
    slope = transform.derivative(raw)
    if temperature != 1.0:
        logits, slope = logits / temperature, slope / temperature
    return logits, slope


def logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         transform: LogitTransform = LogitTransform(), temperature: float = 1.0, chunk_rows: int = 1024,
                         in_place: bool = False, known: tuple[torch.Tensor, torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row log-prob of `targets` and entropy under softmax(transform(hidden W^T + b) / temperature).

    `in_place`: the weight's gradient may be added straight into `weight.grad` (see `_grad_target`);
    only for a weight that nothing else in the graph uses (an LM head not tied to the embeddings),
    since autograd's own accumulation of another use would not be ordered with it across threads.
    `known`: the (log-probs, entropy) these rows are known to have (an activation recomputation): returned
    as they are, with the graph of their backward, and the forward's logits are not computed again.
    """
    return _ChunkedLogprobEntropy.apply(hidden, weight, bias, targets, transform, temperature, chunk_rows, in_place,
                                        known)


@dataclass
class PolicyHead:
    """The policy's per-token outputs: log-prob of each token given its prefix, and the entropy there.

    `shifted`: the output for token j comes from the hidden state at position j - 1 (for a node's
    first token, from its parent's last position: the fork logits).
    """

    temperature: float = 1.0
    chunk_rows: int = 1024  # at most: fewer where CHUNK_LOGITS logits would be exceeded (a large vocabulary)
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
        return self.replay(model, hidden, targets, known=None)

    def replay(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor,
               known: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The outputs with their graph, for rows whose outputs are `known` (a recomputation for the backward):
        the LM head's forward matmul, about a quarter of a small model's forward, is skipped."""
        lm_head = model.get_output_embeddings()
        untied = lm_head.weight is not model.get_input_embeddings().weight
        values = None if known is None else (known["logprobs"], known["entropy"])
        rows = min(self.chunk_rows, max(1, CHUNK_LOGITS // lm_head.weight.shape[0]))
        logprobs, entropy = logprobs_and_entropy(hidden, lm_head.weight, lm_head.bias, targets, logit_transform(model),
                                                 self.temperature, rows, in_place=untied, known=values)
        return {"logprobs": logprobs, "entropy": entropy}


# Logits of one chunk at most (256 MiB in float32): 1024 rows of a 49,152-token head, 256 of Gemma 3's 262,144 (whose
# 1024-row chunks peaked at 5.8 GiB for the head's forward and backward, against 2.2 GiB at 256 rows).
CHUNK_LOGITS = 1 << 26


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

    def replay(self, model: PreTrainedModel, hidden: torch.Tensor, targets: torch.Tensor,
               known: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The same as a call: a value layer is too small to be worth skipping."""
        return self(model, hidden, targets)
