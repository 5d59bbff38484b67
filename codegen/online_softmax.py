"""The online-softmax step both attention templates run per block of keys (flash style)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, v, m, lsum, acc):
    """Fold one block into the running state: scores ``s`` ``[R, N]`` (masked keys -inf),
    values ``v`` ``[N, D]``; ``m``/``lsum`` ``[R]`` are the running max and sum of
    exponentials, ``acc`` ``[R, D]`` the unnormalized output. Returns the new three."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, lsum, acc
