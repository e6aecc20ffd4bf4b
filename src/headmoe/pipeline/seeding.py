"""Seeded CPU generators that use every bit of a 63-bit seed.

`torch.Generator.manual_seed` keeps the seed but initialises the CPU Mersenne Twister from
its low 32 bits only, so seeds 0 and 2**32 draw the same noise. `seeded_generator(seed)`
equals ``torch.Generator().manual_seed(seed)`` for every seed below 2**32 (the draws, and so
every recorded hash, are unchanged) and, for larger seeds, sets the twister's 624-word state
from both 32-bit halves of the seed with the twister's array initialisation (Matsumoto and
Nishimura's ``init_by_array``), so distinct seeds give distinct streams.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from headmoe.config import is_int

SEED_LIMIT = 1 << 63
"""Seeds are integers in [0, SEED_LIMIT)."""
_N = 624
_MASK = 0xFFFFFFFF
# CPUGeneratorImplState: the_initial_seed u64, left i32, seeded i32, next u64, state[624] u64
_HEAD = struct.Struct("<QiiQ")
_STATE_OFFSET = _HEAD.size


def _init_genrand(seed: int) -> list[int]:
    mt = [seed & _MASK]
    for i in range(1, _N):
        prev = mt[-1]
        mt.append((1812433253 * (prev ^ (prev >> 30)) + i) & _MASK)
    return mt


def _init_by_array(key: list[int]) -> list[int]:
    mt = _init_genrand(19650218)
    i, j = 1, 0
    for _ in range(max(_N, len(key))):
        prev = mt[i - 1]
        mt[i] = ((mt[i] ^ ((prev ^ (prev >> 30)) * 1664525)) + key[j] + j) & _MASK
        i, j = i + 1, j + 1
        if i >= _N:
            mt[0], i = mt[_N - 1], 1
        if j >= len(key):
            j = 0
    for _ in range(_N - 1):
        prev = mt[i - 1]
        mt[i] = ((mt[i] ^ ((prev ^ (prev >> 30)) * 1566083941)) - i) & _MASK
        i += 1
        if i >= _N:
            mt[0], i = mt[_N - 1], 1
    mt[0] = 0x80000000
    return mt


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` if it is an int in [0, 2**63); else `ValueError` naming ``name``."""
    if not is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**63), got {seed!r}")
    return seed


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator whose stream depends on all 63 bits of ``seed`` (see module doc)."""
    check_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if seed <= _MASK:
        return gen
    words = _init_by_array([seed & _MASK, seed >> 32])
    raw = bytearray(gen.get_state().numpy().tobytes())
    _HEAD.pack_into(raw, 0, seed, 1, 1, 0)  # left 1, next 0: the state as freshly seeded
    struct.pack_into(f"<{_N}Q", raw, _STATE_OFFSET, *words)
    gen.set_state(torch.from_numpy(np.frombuffer(bytes(raw), dtype=np.uint8).copy()))
    return gen
