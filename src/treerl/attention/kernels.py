"""Attention kernels that also return the log-sum-exp, so partial attentions can be merged.

Step 5 (docs/architecture.md): the kernels each layer's tree attention merges.

Tree attention splits one softmax over `[ancestor keys | own keys]` into two kernel calls and
merges them by log-sum-exp. Its backward calls each part's kernel backward with the *merged*
output and log-sum-exp (as ring attention does), which gives the exact gradient.

What a layer's scores are is an `AttentionSpec`: the scale, and the features some models add
(tanh soft-capping, a sliding window, chunked attention). Queries and keys of one part each sit
at a contiguous run of absolute positions (`q_start`, `k_start`; keys also every R-th), which is all
a window or a chunk needs.

Backends, for plain scores: PyTorch's flash kernels (CPU: any float dtype; CUDA: fp16/bf16) and,
for float32 on CUDA, its memory-efficient kernel (which also returns the log-sum-exp), so no
backend builds a `[L, S]` score matrix. Everything else (soft-capping, a window or chunk that
binds, float64 on CUDA) runs an exact math version with an explicit mask, in at least float32
whatever autocast says. All take `q [B, H, L, D]`, `k [B, H, S, D]`, `v [B, H, S, Dv]` with equal
head counts (callers expand grouped K/V heads). `attend` returns `out [B, H, L, Dv]`,
`lse [B, H, L]` and what the backend's backward needs besides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class Part:
    """Where one partial attention's queries and keys sit (absolute positions), and whether it is causal.

    Query i sits at `q_start + i`, or at `q_start + i % q_period` when several rows of the same
    positions are folded into one long query, or at `q_positions[i]` when the queries come from
    several tree nodes packed in one row (`q_max`: their largest position, known on the host).
    Key j sits at `k_start + j * k_stride` (a stride: one context-parallel rank's share of the path, every R-th).
    """

    q_start: int
    k_start: int
    causal: bool
    q_period: int | None = None
    q_positions: torch.Tensor | None = None
    q_max: int | None = None
    later: bool = False  # only the keys after each query: the rest of a block whose tokens attend both ways (Gemma 3's images)
    k_stride: int = 1

    def query_positions(self, q_len: int, device=None) -> torch.Tensor:
        if self.q_positions is not None:
            return self.q_positions
        i = torch.arange(q_len, device=device)
        return self.q_start + (i % self.q_period if self.q_period else i)

    def last_query(self, q_len: int) -> int:
        """The largest query position."""
        if self.q_positions is not None:
            return self.q_max
        return self.q_start + min(q_len, self.q_period or q_len) - 1


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer forms its attention scores (beyond q . k): everything a model can ask for."""

    scale: float
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)   (Gemma-2)
    window: int | None = None  # key k visible to query q iff q - k < window      (sliding window)
    chunk: int | None = None  # ... iff q // chunk == k // chunk                   (chunked attention)

    def binds(self, part: Part, q_len: int, k_len: int) -> bool:
        """Whether the window or chunk hides a key that causality alone would show."""
        q_last = part.last_query(q_len)
        k_first = part.k_start
        if self.window is not None and q_last - k_first >= self.window:
            return True
        return self.chunk is not None and q_last // self.chunk != k_first // self.chunk

    def visible(self, part: Part, q_len: int, k_len: int, device=None) -> torch.Tensor:
        """Boolean `[q_len, k_len]`: which keys each query may see."""
        q = part.query_positions(q_len, device)[:, None]
        k = torch.arange(part.k_start, part.k_start + k_len * part.k_stride, part.k_stride, device=device)[None, :]
        if part.later:
            allowed = k > q
        else:
            allowed = k <= q if part.causal else torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.window is not None:
            allowed = allowed & (q - k < self.window)
        if self.chunk is not None:
            allowed = allowed & (q // self.chunk == k // self.chunk)
        return allowed


def backend(q: torch.Tensor, spec: AttentionSpec, part: Part, k_len: int) -> str:
    """Which kernel runs: a fused one where the scores are plain, the exact math version otherwise."""
    plain = spec.softcap is None and not part.later and not spec.binds(part, q.shape[-2], k_len)
    return fused_backend(q.device.type, q.dtype) if plain else "math"


def fused_backend(device_type: str, dtype: torch.dtype) -> str:
    """The fused kernel PyTorch has for plain scores on this device and dtype ("math" where it has none)."""
    if device_type == "cpu":
        return "cpu-flash"
    if device_type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return "cuda-flash"
    if device_type == "cuda" and dtype == torch.float32:
        return "cuda-efficient"
    return "math"


def attend(q, k, v, spec: AttentionSpec, part: Part, kind: str | None = None):
    """softmax(scores(q, k)) v over the visible keys, the row log-sum-exp of the scores, and backward state."""
    kind = kind or backend(q, spec, part, k.shape[-2])
    if kind == "math":
        with _no_autocast(q):
            scores = _scores(q, k, spec, part)
            lse = torch.logsumexp(scores, dim=-1)  # -inf where a query sees no key of this part
            probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None]).to(v.dtype)
            return probs @ v, lse, ()
    q, k, v, dv = _same_head_dim(q, k, v)
    if kind == "cpu-flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, part.causal, scale=spec.scale)
        return out[..., :dv], lse, ()
    if kind == "cuda-efficient":
        # Tested on an H100 (tests/engine/test_cuda.py, gpu; not in CI). The kernel pads the log-sum-exp's rows to a
        # multiple of 32; its backward reads the merged one at that padded shape (see attend_backward).
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, part.causal, scale=spec.scale
        )
        return out[..., :dv], lse[..., : q.shape[-2]], (seed, offset, lse.shape[-1])
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, part.causal, False, scale=spec.scale
    )
    return out[..., :dv], lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def attend_backward(dout, q, k, v, out, lse, saved: tuple, spec: AttentionSpec, part: Part, kind: str | None = None):
    """Gradients w.r.t. q, k, v of one part, given the merged output and log-sum-exp."""
    kind = kind or backend(q, spec, part, k.shape[-2])
    if kind == "math":
        with _no_autocast(q):
            return _math_backward(dout, q, k, v, out, lse, spec, part)
    dqk, dv_dim = q.shape[-1], v.shape[-1]
    q, k, v, _ = _same_head_dim(q, k, v)
    dout, out = _pad_last(dout, q.shape[-1]), _pad_last(out, q.shape[-1])
    if kind == "cpu-flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, part.causal, scale=spec.scale
        )
    elif kind == "cuda-efficient":
        seed, offset, lse_rows = saved
        lse = F.pad(lse.float(), (0, lse_rows - lse.shape[-1])).contiguous()
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), None, out.contiguous(), lse, seed,
            offset, 0.0, [True, True, True, False], part.causal, scale=spec.scale
        )
    else:
        # The engines hand row slices of their running (out, lse) (views); the kernel reads lse as a dense
        # [B, H, L] buffer, so a view's strides would be ignored (gradients off by 1e4 on an H100 before this).
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.float().contiguous(), cum_q, cum_k, max_q, max_k, 0.0,
            part.causal, seed, offset, scale=spec.scale
        )
    return dq[..., :dqk], dk[..., :dqk], dv[..., :dv_dim]


def _no_autocast(x: torch.Tensor):
    """The math version computes in the dtypes it chooses (at least float32), not in autocast's."""
    return torch.autocast(x.device.type, enabled=False)


def _same_head_dim(q, k, v):
    """Flash kernels need one head size for q, k and v: pad the smaller with zeros (scores unchanged)."""
    d = max(q.shape[-1], v.shape[-1])
    return _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), v.shape[-1]


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _raw_scores(q, k, spec: AttentionSpec) -> torch.Tensor:
    compute = torch.promote_types(q.dtype, torch.float32)
    return (q.to(compute) @ k.to(compute).transpose(-1, -2)) * spec.scale


def _scores(q, k, spec: AttentionSpec, part: Part, raw: torch.Tensor | None = None) -> torch.Tensor:
    """The scores the softmax sees: scaled, soft-capped, -inf where a key is not visible."""
    scores = _raw_scores(q, k, spec) if raw is None else raw
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    hide = ~spec.visible(part, q.shape[-2], k.shape[-2], q.device)
    return scores.masked_fill(hide, float("-inf"))  # always: asking whether anything is hidden would sync the device


def _math_backward(dout, q, k, v, out, lse, spec: AttentionSpec, part: Part):
    raw = _raw_scores(q, k, spec)
    compute = raw.dtype
    probs = torch.exp(_scores(q, k, spec, part, raw) - lse.to(compute).nan_to_num(neginf=0.0)[..., None])
    dout_c, v_c = dout.to(compute), v.to(compute)
    dv = probs.transpose(-1, -2) @ dout_c
    dprobs = dout_c @ v_c.transpose(-1, -2)
    dscores = probs * (dprobs - (dout_c * out.to(compute)).sum(-1, keepdim=True))
    if spec.softcap is not None:  # d/dx [c tanh(x / c)] = 1 - tanh^2(x / c)
        dscores = dscores * (1 - torch.tanh(raw / spec.softcap) ** 2)
    dscores = dscores * spec.scale
    dq, dk = dscores @ k.to(compute), dscores.transpose(-1, -2) @ q.to(compute)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor | None = None):
    """Combine partial attentions over disjoint key sets into the attention over their union.

    `sink` (broadcastable to the lse, e.g. `[1, H, 1]`): a learned logit per head that joins the
    softmax's denominator with a zero value (attention sinks, gpt-oss).
    """
    if len(parts) == 1 and sink is None:
        return parts[0]
    lses = [lse for _, lse in parts]
    if sink is not None:
        lses.append(sink.to(lses[0].dtype).expand_as(lses[0]))
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    safe = lse.nan_to_num(neginf=0.0)
    out = sum(o.to(lse.dtype) * torch.exp(part_lse - safe)[..., None] for o, part_lse in parts)
    return out.to(parts[0][0].dtype), lse
