"""Attention kernels that also return the log-sum-exp, so partial attentions can be merged.

Tree attention splits one softmax over `[ancestor keys | own keys]` into two kernel calls and
merges them by log-sum-exp. Its backward calls each part's kernel backward with the *merged*
output and log-sum-exp (as ring attention does), which gives the exact gradient.

Backends: PyTorch's flash kernels (CPU: any float dtype; CUDA: fp16/bf16), and a plain math
version for everything else. All take `q [B, H, L, D]`, `k, v [B, H, S, D]` with equal head
counts (callers expand grouped K/V heads). `attend` returns `out [B, H, L, D]`, `lse [B, H, L]`
and what the backend's backward needs besides.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def backend(q: torch.Tensor) -> str:
    """Which kernel runs on this device and dtype."""
    if q.device.type == "cpu":
        return "cpu-flash"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda-flash"
    return "math"


def attend(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """softmax(q k^T * scale [+ causal mask]) v, the row log-sum-exp of the scores, and backward state."""
    kind = backend(q)
    if kind == "cpu-flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    if kind == "cuda-flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(v.dtype)
    return probs @ v, lse, ()


def attend_backward(dout, q, k, v, out, lse, saved: tuple, scale: float, causal: bool):
    """Gradients w.r.t. q, k, v of one part, given the merged output and log-sum-exp."""
    kind = backend(q)
    if kind == "cpu-flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kind == "cuda-flash":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    compute = lse.dtype
    probs = torch.exp(_scores(q, k, scale, causal) - lse[..., None])
    dout_c, v_c = dout.to(compute), v.to(compute)
    dv = probs.transpose(-1, -2) @ dout_c
    dprobs = dout_c @ v_c.transpose(-1, -2)
    dscores = probs * (dprobs - (dout_c * out.to(compute)).sum(-1, keepdim=True)) * scale
    dq, dk = dscores @ k.to(compute), dscores.transpose(-1, -2) @ q.to(compute)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine partial attentions over disjoint key sets into the attention over their union."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
    out = sum(o.to(lse.dtype) * torch.exp(part_lse - lse)[..., None] for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse
