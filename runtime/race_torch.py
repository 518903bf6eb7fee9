"""The exponential race's noise (runtime/race.py) in torch, for the device loop
(runtime/device/verify.py, which the SpecVerify op's torch form is too): the same field
E(seed, position, id), so a GPU run and a CPU run race alike wherever their distributions
agree. The hashes are bit for bit NumPy's; E = -log u is too on the CPU, and on a GPU within
an ulp of it (another libm: a tie that close decides nothing measurable).

torch has no uint64: the hash runs on int64, whose multiplications wrap as uint64's do (two's
complement), with the logical right shifts emulated by a mask (`srl`). On a
device the whole field of a row is drawn (no blocks' bounds: a fixed shape, no host sync, so
a CUDA graph captures it); the winner is the NumPy race's, which is the whole field's
(tests/test_sampler.py, tests/test_race_torch.py).

Batched, the race is taken in the log domain: argmin_v E_v / p(v) = argmax_v log p(v) -
log E_v, and log p = z - logsumexp(z) with the row's constant dropped, so a row's scaled and
filtered logits z (temperature, top-k, top-p: -inf where ruled out) race without a softmax:

    token = argmax_v  z(v) - log E(seed, position, v)
"""

from __future__ import annotations

import torch

from trt_spec.runtime.race import BLOCK, GOLDEN, LEVELS, M1, M2, MASK

def signed(x: int) -> int:
    """A uint64 constant as the int64 with its bits."""
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def srl(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 z by n bits (uint64's >>): an arithmetic shift copies the
    sign bit, which the mask clears (the ONNX exporter writes the shift as BitShift on the
    bits with the sign filled back: exact under ONNX Runtime, tests/test_plugins_spec_verify.py)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits (race.mix_array)."""
    z = (z ^ srl(z, 30)) * signed(M1)
    z = (z ^ srl(z, 27)) * signed(M2)
    return z ^ srl(z, 31)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """seed [B] (uint64 bits as int64), position [B, R] (output positions, >= 0) -> the rows'
    keys [B, R] (race.row_key)."""
    return mix(seed.view(-1, 1) ^ mix((position + 1) * signed(GOLDEN)))


def hashes(key: int | torch.Tensor, ids: torch.Tensor, level: int) -> torch.Tensor:
    """ids [n] int64 -> [..., n] the hashes of (key, id, level), as int64 bits (race.hashes);
    key: one row's (int) or a tensor of keys [..., 1]."""
    x = (ids * LEVELS + level) * signed(GOLDEN)
    return mix((signed(key) if isinstance(key, int) else key) ^ mix(x))


def exponentials(key: int | torch.Tensor, ids: torch.Tensor, level: int) -> torch.Tensor:
    """[..., n] float64 Exp(1) draws: -log u, u = (top 53 bits + 1) / 2^53 (race.exponentials)."""
    u = (srl(hashes(key, ids, level), 11) + 1).to(torch.float64) * 2.0 ** -53
    return -torch.log(u)


def field_at(key: int | torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The clocks E [..., n] float64 of ids [n] (< vocab) in the fields of keys [..., 1] (or one
    int key) over `vocab` ids (race.clocks of race.block_minima): a block's minimum at its
    offset, the minimum plus a fresh Exp(1) elsewhere."""
    blocks = torch.arange(-(-vocab // BLOCK), device=ids.device)
    sizes = torch.clamp(vocab - blocks * BLOCK, max=BLOCK)  # [blocks]
    m = exponentials(key, blocks, 0) / sizes  # [..., blocks]
    j = (srl(hashes(key, blocks, 1), 32) * sizes) >> 32  # < 2^40: no sign to mind
    b = ids // BLOCK
    e = m[..., b] + exponentials(key, ids, 2)
    return torch.where(ids - b * BLOCK == j[..., b], m[..., b], e)


def race_logits(z: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, vocab: int,
                ids: torch.Tensor | None = None) -> torch.Tensor:
    """z [B, R, V'] a row's log-weights up to a constant (scaled, filtered logits; -inf: never
    drawn), seed [B], position [B, R] -> [B, R] the race's winner among the V' columns: argmax
    z - log E (module docstring), E the target's field over `vocab` ids at the columns' ids
    (None: column v is id v, V' = vocab; else ids [V'], a draft vocabulary's target ids, so a
    drafter races with the target's own noise, id for id). A row with every column at -inf
    gives column 0 (NumPy's race gives argmax p = 0 there too)."""
    cols = torch.arange(vocab, device=z.device) if ids is None else ids
    e = field_at(row_keys(seed, position)[..., None], cols, vocab)  # [B, R, V']
    z = z.to(torch.float64)
    # (-inf - log 0 would be NaN, which argmax takes for the largest)
    return torch.where(z > -torch.inf, z - torch.log(e), -torch.inf).argmax(-1)
