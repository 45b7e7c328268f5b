"""C++'s ``std::mt19937`` and ``std::mt19937_64``, draw for draw.

Megatron-Core's masked datasets choose sample lengths with ``std::mt19937`` and shuffle samples
with ``std::mt19937_64`` (in its compiled helpers); the same samples need the same streams.
numpy has no 64-bit Mersenne Twister, so both are written out here from the published
parameters (Matsumoto & Nishimura; the C++ standard's [rand.predef] pins the 10000th output of
each, which the tests check). Pure Python: the index builders draw one number per sample.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Parameters:
    width: int
    state_size: int  # n
    shift_size: int  # m
    mask_bits: int  # r
    xor_mask: int  # a
    tempering: tuple[int, int, int, int, int, int, int]  # u, d, s, b, t, c, l
    init_multiplier: int  # f


MT19937 = _Parameters(32, 624, 397, 31, 0x9908B0DF,
                      (11, 0xFFFFFFFF, 7, 0x9D2C5680, 15, 0xEFC60000, 18), 1812433253)
MT19937_64 = _Parameters(64, 312, 156, 31, 0xB5026F5AA96619E9,
                         (29, 0x5555555555555555, 17, 0x71D67FFFEDA60000, 37, 0xFFF7EEE000000000, 43),
                         6364136223846793005)


class MersenneTwister:
    """``next()`` gives the generator's next output, as ``std::mersenne_twister_engine(seed)()``."""

    def __init__(self, seed: int, params: _Parameters = MT19937):
        self.params = params
        self._word_mask = (1 << params.width) - 1
        self._lower_mask = (1 << params.mask_bits) - 1
        self._upper_mask = self._word_mask & ~self._lower_mask
        state = [seed & self._word_mask]
        for i in range(1, params.state_size):
            previous = state[-1]
            state.append((params.init_multiplier * (previous ^ (previous >> (params.width - 2))) + i)
                         & self._word_mask)
        self._state = state
        self._index = params.state_size  # twist before the first output

    def _twist(self) -> None:
        n, m, a = self.params.state_size, self.params.shift_size, self.params.xor_mask
        state, upper, lower = self._state, self._upper_mask, self._lower_mask
        for i in range(n):
            y = (state[i] & upper) | (state[(i + 1) % n] & lower)
            state[i] = state[(i + m) % n] ^ (y >> 1) ^ (a if y & 1 else 0)
        self._index = 0

    def next(self) -> int:
        if self._index >= self.params.state_size:
            self._twist()
        y = self._state[self._index]
        self._index += 1
        u, d, s, b, t, c, l = self.params.tempering
        y ^= (y >> u) & d
        y ^= (y << s) & b
        y ^= (y << t) & c
        y ^= y >> l
        return y & self._word_mask
