"""The exponential race's noise (runtime/race.py) in torch, for the device loop: the same
field E(seed, position, id), so a GPU run and a CPU run race alike wherever their
distributions agree. The hashes are bit for bit NumPy's; E = -log u is too on the CPU, and
on a GPU within an ulp of it (another libm: a tie that close decides nothing measurable).

torch has no uint64: the hash runs on int64, whose multiplications wrap as uint64's do (two's
complement), with the logical right shifts emulated by a mask (an arithmetic shift copies the
sign bit). On a GPU the whole field of a row is cheap, so `race` draws it whole (no blocks'
bounds); the winner is the NumPy race's, which is the whole field's (tests/test_sampler.py).

Not wired into the device loop yet (runtime/device/, plugins/spec_verify.py keep Leviathan's
rule): tests/test_race_torch.py holds it to runtime/race.py.
"""

from __future__ import annotations

import torch

from trt_spec.runtime.race import BLOCK, GOLDEN, LEVELS, M1, M2, MASK, row_key


def signed(x: int) -> int:
    """A uint64 constant as the int64 with its bits."""
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 z by n bits (uint64's >>)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (race.mix_array)."""
    z = (z ^ srl(z, 30)) * signed(M1)
    z = (z ^ srl(z, 27)) * signed(M2)
    return z ^ srl(z, 31)


def hashes(key: int, ids: torch.Tensor, level: int) -> torch.Tensor:
    """ids [n] int64 -> [n] the hashes of (key, id, level), as int64 bits (race.hashes)."""
    x = (ids * LEVELS + level) * signed(GOLDEN)
    return mix(signed(key) ^ mix(x))


def exponentials(key: int, ids: torch.Tensor, level: int) -> torch.Tensor:
    """[n] float64 Exp(1) draws: -log u, u = (top 53 bits + 1) / 2^53 (race.exponentials)."""
    u = (srl(hashes(key, ids, level), 11) + 1).to(torch.float64) * 2.0 ** -53
    return -torch.log(u)


def field(key: int, vocab: int, device=None) -> torch.Tensor:
    """The row's whole field E [vocab] float64 (race.field)."""
    blocks = torch.arange(-(-vocab // BLOCK), device=device)
    sizes = torch.clamp(vocab - blocks * BLOCK, max=BLOCK)  # [blocks]
    m = exponentials(key, blocks, 0) / sizes
    j = (srl(hashes(key, blocks, 1), 32) * sizes) >> 32  # < 2^40: no sign to mind
    ids = torch.arange(vocab, device=device)
    b = ids // BLOCK
    e = m[b] + exponentials(key, ids, 2)
    return torch.where(ids - b * BLOCK == j[b], m[b], e)


def race(p: torch.Tensor, seed: int, position: int) -> int:
    """p [vocab] nonnegative weights -> argmin_v E / p(v) over the whole field (race.race)."""
    e = field(row_key(seed, position), p.shape[-1], p.device)
    p = p.to(torch.float64)
    times = torch.where(p > 0, e / torch.where(p > 0, p, 1.0), torch.inf)
    return int(torch.argmin(times))
