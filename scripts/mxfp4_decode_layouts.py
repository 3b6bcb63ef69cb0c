"""The fewest instructions per 32-bit word any nibble layout allows for the MXFP4 register decode.

    python scripts/mxfp4_decode_layouts.py        # ~3 minutes on one core

The kernels (pallas_kernels/moe_experts.py, cute_bridge/kernels/mxfp4_moe.py) turn a word of 8
E2M1 codes into 4 bf16 pairs, each pair's bits landing on P = {6, 7, 8, 15} and the same + 16
(magnitude bits e1 e0 m at 8..6, sign at 15; then one fma by the scale). With the checkpoint's
layout that costs 17 instructions (a shared `shr`, then `and`, IMAD, `and`, fma per pair). A
layout repacked at load could place each code's bits anywhere. This searches every partition of
the 32 bits into 4 pairs, a pair decoded either as
  * a translate: one shift (none when already in place), `and` with P's mask, fma (3, or 2);
  * the IMAD form: `and` isolating the pair, one multiply applying a different left shift to each
    of its 4 bit groups at once (the shifted copies must not overlap), `and`, fma (4), from the
    word or from a copy shifted right once (one `shr`, shared by the pairs that use it).
Result (session 8): 14 at best (17 now), e.g. one pair in place, one translate, two IMAD pairs.
"""

from __future__ import annotations

import functools
import itertools

GROUPS = ((6, 7, 8), (15,), (22, 23, 24), (31,))   # a bf16 pair's magnitude and sign bits
FULL = (1 << 32) - 1


def mask(bits) -> int:
    return sum(1 << b for b in bits)


def translates() -> dict[int, int]:
    """{source bit mask: cost} of the pairs one shift places."""
    out = {}
    for s in range(-31, 32):
        src = [b + s for g in GROUPS for b in g]
        if all(0 <= b < 32 for b in src):
            out[mask(src)] = 2 if s == 0 else 3
    return out


def imad_sources() -> set[int]:
    """Source masks (before any pre-shift) of the pairs one isolate-multiply-and places."""
    target = mask(b for g in GROUPS for b in g)
    found = set()
    for shifts in itertools.product(range(32), repeat=len(GROUPS)):
        if len(set(shifts)) < 2:
            continue          # one shift: a translate
        src = [b - k for g, k in zip(GROUPS, shifts) for b in g]
        if min(src) < 0 or len(set(src)) < len(src):
            continue
        m = mask(src)
        copies = {k: (m << k) & FULL for k in set(shifts)}
        if any(a & b for a, b in itertools.combinations(copies.values(), 2)):
            continue          # overlapping copies would carry
        # every target bit must come from its own group's shift, not another copy
        if all(copies[k] & target & mask(g) == mask(g) and all(copies[j] & mask(g) == 0 for j in copies if j != k)
               for g, k in zip(GROUPS, shifts)):
            found.add(m)
    return found


def best_partition() -> tuple[int, list]:
    pairs = [(m, c, 0) for m, c in translates().items()]
    for m in imad_sources():
        for t in range(32):                   # the word shifted right by t first
            if (m << t) <= FULL:
                pairs.append((m << t, 4, t))

    @functools.lru_cache(maxsize=None)
    def solve(covered: int, shifts: frozenset) -> tuple[int, tuple]:
        if covered == FULL:
            return len(shifts - {0}), ()
        low = (~covered & -~covered).bit_length() - 1
        best = (10 ** 9, ())
        for m, c, t in pairs:
            if m >> low & 1 and not m & covered:
                cost, rest = solve(covered | m, shifts | {t})
                if c + cost < best[0]:
                    best = (c + cost, ((f"{m:032b}", c, t),) + rest)
        return best

    return solve(0, frozenset())


if __name__ == "__main__":
    cost, parts = best_partition()
    print(f"fewest instructions per word: {cost} (checkpoint layout: 17)")
    for bits, c, t in parts:
        print(f"  source bits {bits}  {c} instructions" + (f", word pre-shifted right by {t}" if t else ""))
