"""Sampling whose randomness belongs to the output position: the exponential race.

The token at output position i of a stream with seed s is a fixed function of (s, i) and the
distribution p it is drawn from:

    token = argmin_v E(s, i, v) / p(v)        E(s, i, v) ~ Exp(1), independent over v

(the exponential race; equivalently Gumbel-max, argmax_v log p(v) - log E). Its marginal is
exactly p: the v-th clock E_v / p(v) is Exp(p(v)), and the first of independent exponential
clocks is v with probability p(v) / sum p. The noise is keyed by (s, i, v) alone, never by
how many numbers a step drew, so plain decoding and every speculative method emit the same
token at i (runtime/verify.py), and a model drafter that draws its draft at i with the same
noise on its q is coupled to the target (Daliri, Musco and Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding": the two agree with probability
at least (1 - TV(p, q)) / (1 + TV(p, q))). Choice c of a request seeded s has seed s + c
(runtime/scheduler.py).

Counter-based noise: a 64-bit mixing hash (splitmix64's finalizer) of (seed, position,
index, level), in wrapping uint64 arithmetic, so that a torch twin (int64, with logical
right shifts emulated by masks) can reproduce it bit for bit; a uniform is the top 53 bits,
u = (h >> 11 + 1) / 2^53 in (0, 1], and E = -log u.

The race without a full-vocabulary draw. The vocabulary is cut into blocks of BLOCK ids
(the last may be shorter, n_b ids). Block b's clocks are generated from its minimum down:

    m_b = E(s, i, b, level 0) / n_b          the block's smallest clock, ~ Exp(n_b)
    j_b = uniform in 0..n_b-1 (level 1)      which id holds it
    E_v = m_b + E(s, i, v, level 2)          every other id of the block (memorylessness)

which is exactly n_b independent Exp(1) (the minimum of n iid Exp(1) is Exp(n), its
position uniform, and the rest, given it, are it plus fresh Exp(1)). So the field E is a
fixed function of (s, i, v), and within block b every time E_v / p(v) is at least
m_b / max_b p, and an id's at least m_b / p(v). Where few ids have weight (top-p, top-k,
min-p, a grammar) only they are drawn (and their blocks' minima); else the block of the
smallest bound is drawn whole, then, at once, the ids of every block whose bound beats the
best time found whose own bound m_b / p(v) beats it too. The winner is the whole field's
race, exactly; a row costs one pass over p, one hash per block and a few hundred more
(on SmolLM2's 49,152 ids, against 49,152 for the whole field).
"""

from __future__ import annotations

import numpy as np

BLOCK = 256  # ids per block of the race
MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio)
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer multipliers
LEVELS = 3  # 0: a block's minimum, 1: where it lies, 2: an id's own clock
_U64 = np.uint64


def mix(z: int) -> int:
    """splitmix64's finalizer on a Python int (the per-row key, computed once)."""
    z &= MASK
    z = ((z ^ (z >> 30)) * M1) & MASK
    z = ((z ^ (z >> 27)) * M2) & MASK
    return z ^ (z >> 31)


def mix_array(z: np.ndarray) -> np.ndarray:
    """mix over a uint64 array (wrapping multiplications, as mix's masks)."""
    z = z ^ (z >> _U64(30))
    z *= _U64(M1)
    z ^= z >> _U64(27)
    z *= _U64(M2)
    return z ^ (z >> _U64(31))


def row_key(seed: int, position: int) -> int:
    """The key of output position `position` (0: the first output token) of seed `seed`."""
    assert seed is not None and 0 <= seed <= MASK and position >= 0, (seed, position)
    return mix(seed ^ mix((position + 1) * GOLDEN))


def hashes(key: int, ids: np.ndarray, level: int) -> np.ndarray:
    """ids [n] (block or token ids) -> [n] uint64 hashes of (key, id, level)."""
    assert 0 <= level < LEVELS, level
    x = ids.astype(np.uint64) * _U64(LEVELS) + _U64(level)  # [n] distinct per (id, level)
    return mix_array(_U64(key) ^ mix_array(x * _U64(GOLDEN)))


def exponentials(key: int, ids: np.ndarray, level: int) -> np.ndarray:
    """[n] Exp(1) draws: -log u, u = (top 53 bits + 1) / 2^53 in (0, 1]."""
    u = ((hashes(key, ids, level) >> _U64(11)) + _U64(1)).astype(np.float64) * 2.0 ** -53
    return -np.log(u)


def block_minima(key: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The blocks' smallest clocks m [blocks] and where each lies, j [blocks] (offsets in the
    block), of a row's field over `vocab` ids."""
    blocks = np.arange(-(-vocab // BLOCK))
    sizes = np.minimum(BLOCK, vocab - blocks * BLOCK)  # [blocks]
    m = exponentials(key, blocks, 0) / sizes
    # position: the top 32 bits scaled to the block (Lemire's multiply-shift)
    j = ((hashes(key, blocks, 1) >> _U64(32)) * sizes.astype(np.uint64)) >> _U64(32)
    return m, j.astype(np.int64)


def clocks(key: int, ids: np.ndarray, minima: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """The clocks E [n] of ids [n], given the row's block_minima (m, j): the block's minimum
    m_b at its offset j_b, m_b + a fresh Exp(1) elsewhere."""
    m, j = minima
    b = ids // BLOCK
    e = m[b] + exponentials(key, ids, 2)
    at_min = ids - b * BLOCK == j[b]
    e[at_min] = m[b[at_min]]
    return e


def field(key: int, vocab: int) -> np.ndarray:
    """The whole field E [vocab] of a row (for tests: race(p) is argmin E / p over it)."""
    return clocks(key, np.arange(vocab), block_minima(key, vocab))


def first(p: np.ndarray, ids: np.ndarray, e: np.ndarray) -> tuple[int, float]:
    """(id, time) of the first clock e / p[ids] to ring among ids [n] (p(id) > 0 for some);
    an id of weight 0 never rings."""
    w = p[ids]
    live = w > 0
    if not live.all():
        ids, e, w = ids[live], e[live], w[live]
    times = e / w
    t = int(np.argmin(times))
    return int(ids[t]), float(times[t])


SPARSE = 4096  # a distribution with at most this many ids of weight > 0 races them alone


def race(p: np.ndarray, seed: int, position: int) -> int:
    """p [vocab] nonnegative weights -> argmin_v E(seed, position, v) / p(v). A token of
    weight 0 is never returned (a row without any, a grammar's dead end that its guide
    reports, gives argmax p, as greedy decoding would). Only ids that can win are drawn (module docstring): where
    few ids have weight (top-p, top-k, min-p, a grammar), those; else the block whose bound
    m_b / max_b p is smallest, then at once every block whose bound beats its best time."""
    vocab = len(p)
    key = row_key(seed, position)
    live = p > 0  # (a boolean's nonzero is ~10x a float64's)
    n = np.count_nonzero(live)
    if not n:
        return int(np.argmax(p))
    minima = block_minima(key, vocab)
    if n <= SPARSE:
        support = live.nonzero()[0]
        return first(p, support, clocks(key, support, minima))[0]
    m = minima[0]
    pmax = np.maximum.reduceat(p, np.arange(0, vocab, BLOCK))  # [blocks]
    bound = np.full(len(m), np.inf)  # [blocks] no clock of block b rings before bound[b]
    np.divide(m, pmax, out=bound, where=pmax > 0)
    b0 = int(np.argmin(bound))
    ids = np.arange(b0 * BLOCK, min(vocab, (b0 + 1) * BLOCK))
    best, best_time = first(p, ids, clocks(key, ids, minima))
    rest = np.flatnonzero(bound < best_time)
    rest = rest[rest != b0]
    if len(rest):
        # an id's clock is at least its block's minimum: only ids with m_b / p(v) below the
        # best time can still ring first
        grid = p if vocab % BLOCK == 0 else np.pad(p, (0, -vocab % BLOCK))
        rows, cols = (grid.reshape(-1, BLOCK)[rest] * best_time > m[rest, None]).nonzero()
        ids = rest[rows] * BLOCK + cols  # [n] the ids that can still ring first
        if len(ids):
            other, time = first(p, ids, clocks(key, ids, minima))
            if time < best_time:
                best = other
    return best
