"""The SpecVerify Triton kernel (see plugins/spec_verify.py for the op's definition).

Kept in its own module because it imports triton at the top: plugins/spec_verify.py imports it
only when `spec_verify_triton` is first called, so everything else imports without triton.
One program per batch row; the vocabulary is walked in BLOCK_V chunks (online softmax for the
row statistics, then a running CDF for the inverse-CDF draw).
"""

import triton
import triton.language as tl


@triton.jit
def _row_stats(row, inv_t, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """Online max / sum(exp) of row * inv_t, and the argmax of row, over V."""
    m = float("-inf")
    s = 0.0
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < V
        z = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32)
        bmax = tl.max(z, 0)
        bi = tl.argmax(z, 0) + start
        better = bmax > best
        best_i = tl.where(better, bi, best_i)
        best = tl.where(better, bmax, best)
        zt = z * inv_t
        m_new = tl.maximum(m, tl.max(zt, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.where(inb, tl.exp(zt - m_safe), 0.0), 0)
        m = m_new
    return m, s, best_i

# K and V are compile-time constants: one specialisation per (draft length, vocab), which
# unrolls the draft loop (k is small) and fixes the vocab blocking.
@triton.jit
def spec_verify_kernel(draft_ptr, lens_ptr, logits_ptr, q_ptr, u_ptr, temp_ptr,
                       acc_ptr, tok_ptr, K: tl.constexpr, V: tl.constexpr, FULL_Q: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    temp = tl.load(temp_ptr + b).to(tl.float32)
    greedy = temp == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    a = n * 0
    still = n >= 0  # True
    for i in range(0, K):
        x = tl.load(draft_ptr + b * K + i)
        row = logits_ptr + (b * (K + 1) + i) * V
        m, s, best_i = _row_stats(row, inv_t, V, BLOCK_V)
        p_x = tl.exp(tl.load(row + x).to(tl.float32) * inv_t - m) / s
        if FULL_Q:
            q_x = tl.load(q_ptr + (b * K + i) * V + x).to(tl.float32)
        else:
            q_x = 1.0
        q_x = tl.maximum(q_x, 1e-10)
        u = tl.load(u_ptr + b * (K + 1) + i).to(tl.float32)
        ok = tl.where(greedy, x == best_i, u < p_x / q_x) & (i < n)
        still = still & ok
        a = a + still.to(tl.int32)

    # the recovered (a < n) or bonus (a == n) token, from row a
    row = logits_ptr + (b * (K + 1) + a) * V
    m, s, best_i = _row_stats(row, inv_t, V, BLOCK_V)
    rejected = a < n
    x_a = tl.load(draft_ptr + b * K + a, mask=rejected, other=-1)
    q_row = q_ptr + (b * K + a) * V
    # masks below are where(rejected, inb, False), not inb & rejected: the same on a GPU, and
    # triton's CPU interpreter cannot load with a mask made by & of a vector and a scalar
    total = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < V
        z = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32)
        p = tl.exp(z * inv_t - m) / s
        if FULL_Q:
            q = tl.load(q_row + offs, mask=tl.where(rejected, inb, False),  # inb & rejected
                        other=0.0).to(tl.float32)
        else:
            q = tl.where((offs == x_a) & rejected, 1.0, 0.0)
        total += tl.sum(tl.where(inb, tl.maximum(p - q, 0.0), 0.0), 0)
    use_residual = total > 1e-12
    mass = tl.where(use_residual, total, 1.0)
    u_a = tl.load(u_ptr + b * (K + 1) + tl.minimum(a + 1, n)).to(tl.float32)
    target = u_a * mass
    carry = 0.0
    count = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < V
        z = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32)
        p = tl.exp(z * inv_t - m) / s
        if FULL_Q:
            q = tl.load(q_row + offs, mask=tl.where(rejected, inb, False),  # inb & rejected
                        other=0.0).to(tl.float32)
        else:
            q = tl.where((offs == x_a) & rejected, 1.0, 0.0)
        w = tl.where(inb, tl.where(use_residual, tl.maximum(p - q, 0.0), p), 0.0)
        cdf = carry + tl.cumsum(w, 0)
        count += tl.sum(tl.where(inb & (cdf <= target), 1, 0), 0)
        carry += tl.sum(w, 0)
    sampled = tl.minimum(count, V - 1)
    token = tl.where(greedy, best_i, sampled).to(tl.int64)

    tl.store(acc_ptr + b, a.to(tl.int64))
    for j in tl.static_range(K + 1):  # the accepted drafts, then the token, then -1
        x = tl.load(draft_ptr + b * K + j, mask=j < a, other=0)
        tl.store(tok_ptr + b * (K + 1) + j, tl.where(j < a, x, tl.where(j == a, token, -1)))
