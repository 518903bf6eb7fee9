"""The SpecVerify Triton kernel (see plugins/spec_verify.py for the op's definition).

Kept in its own module because it imports triton at the top: plugins/spec_verify.py imports it
only when `spec_verify_triton` is first called, so everything else imports without triton.
One program per batch row; for each of its k + 1 rows the vocabulary is walked in BLOCK_V
chunks with a running argmax: of the logits on a greedy row, else of z / T - log E, the
exponential race in the log domain (runtime/race_torch.py), with E the counter-based field of
runtime/race.py computed here in uint64 (splitmix64's finalizer wraps as NumPy's does), so the
kernel's tokens are runtime/device/verify.py's (tests/test_plugins_spec_verify.py, under
TRITON_INTERPRET=1 on a CPU).
"""

import triton
import triton.language as tl

# runtime/race.py's constants (BLOCK, LEVELS, GOLDEN, M1, M2)
RACE_BLOCK: tl.constexpr = 256
LEVELS: tl.constexpr = 3
GOLDEN: tl.constexpr = 0x9E3779B97F4A7C15
M1: tl.constexpr = 0xBF58476D1CE4E5B9
M2: tl.constexpr = 0x94D049BB133111EB


@triton.jit
def _mix(z):
    """splitmix64's finalizer on uint64 (race.mix_array)."""
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    return z ^ (z >> 31)


@triton.jit
def _hash(key, ids, level: tl.constexpr):
    """uint64 ids -> the hashes of (key, id, level) (race.hashes)."""
    return _mix(key ^ _mix((ids * LEVELS + level) * GOLDEN))


@triton.jit
def _exponential(h):
    """An Exp(1) draw in float64 from a hash: -log u, u = (top 53 bits + 1) / 2^53."""
    u = ((h >> 11) + 1).to(tl.float64) * 1.1102230246251565e-16  # 2^-53
    return -tl.log(u)


@triton.jit
def _clocks(key, offs, V: tl.constexpr):
    """The field E [BLOCK_V] float64 at ids offs (race.clocks of race.block_minima)."""
    v = offs.to(tl.uint64)
    blk = v // RACE_BLOCK
    size = tl.minimum(V - blk * RACE_BLOCK, RACE_BLOCK)  # ids in the block (the last: fewer)
    m = _exponential(_hash(key, blk, 0)) / size.to(tl.float64)  # the block's minimum
    j = ((_hash(key, blk, 1) >> 32) * size) >> 32  # where it lies in the block
    return tl.where(v - blk * RACE_BLOCK == j, m, m + _exponential(_hash(key, v, 2)))


@triton.jit
def _target_token(row, key, temp, greedy, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """The row's token: argmax of its logits (greedy), else argmax z / T - log E (first index
    on ties, as torch's argmax; a row all at -inf gives 0)."""
    best = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        inb = offs < V
        z = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32).to(tl.float64)
        noisy = tl.where(z > float("-inf"), z / temp - tl.log(_clocks(key, offs, V)),
                         float("-inf"))
        score = tl.where(greedy, z, noisy)
        bmax = tl.max(score, 0)
        bi = tl.argmax(score, 0) + start
        better = bmax > best
        best_i = tl.where(better, bi, best_i)
        best = tl.where(better, bmax, best)
    return best_i


# K and V are compile-time constants: one specialisation per (draft length, vocab), which
# unrolls the row loop (k is small) and fixes the vocab blocking.
@triton.jit
def spec_verify_kernel(draft_ptr, lens_ptr, logits_ptr, seed_ptr, pos_ptr, temp_ptr,
                       acc_ptr, tok_ptr, K: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + b).to(tl.int32)
    temp = tl.load(temp_ptr + b).to(tl.float32)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp).to(tl.float64)
    seed = tl.load(seed_ptr + b).to(tl.uint64, bitcast=True)
    pos = tl.load(pos_ptr + b)
    a = n * 0
    still = n >= 0  # every draft before this row accepted: this row's token is emitted
    for i in tl.static_range(K + 1):
        row = logits_ptr + (b * (K + 1) + i) * V
        key = _mix(seed ^ _mix((pos + i + 1).to(tl.uint64, bitcast=True) * GOLDEN))  # row_key
        t = _target_token(row, key, temp, greedy, V, BLOCK_V).to(tl.int64)
        tl.store(tok_ptr + b * (K + 1) + i, tl.where(still, t, -1))
        if i < K:
            x = tl.load(draft_ptr + b * K + i)
            still = still & (x == t) & (i < n)
            a = a + still.to(tl.int32)
    tl.store(acc_ptr + b, a.to(tl.int64))
