"""Noise injection into training triplets, the ConeSep paper's way.

* Which triplets: one fixed order of the triplets, drawn from their index alone
  (``derive_seed("triplet-noise", i)``, never the run's seed); at rate r the first round(r * N) of it
  are noisy. So the shares are exact and nested (20 % within 50 % within 80 %), and every seed and
  mode of an experiment sees the same noisy triplets.
* easy: the modification text of another triplet (a fixed cyclic shift along a second fixed order,
  skipping donors whose text is the same).
* hard: the triplet's ``hard_modification``: a text naming the same kind of edit with another outcome,
  so reference and target still look alike and only the text is wrong (toy triplets carry it).
* tme: TME's construction, which ConeSep's code uses (github iLearn-Lab/CVPR26-ConeSep, ``datasets.py``,
  ``CIRR.shuffle`` / ``FashionIQ.shuffle``): the noisy share, in the fixed order, cut into thirds at
  int(k / 3) and int(2k / 3); the first third's reference images, the second's modification texts and
  the third's target images are each shuffled among their third (a fixed permutation, fixed points
  allowed as in the code; a triplet that keeps its own part counts as clean).
"""

from __future__ import annotations

import random

import torch

from demind.errors import InputError
from demind.seeding import derive_seed

from demind.triplets.config import NOISE_KINDS


def noise_order(n: int) -> list[int]:
    """The fixed order in which triplets become noisy as the rate grows."""
    return sorted(range(n), key=lambda i: (random.Random(derive_seed("triplet-noise", i)).random(), i))


def noisy_mask(n: int, rate: float) -> torch.Tensor:
    """(n,) bool: the first round(rate * n) triplets of :func:`noise_order`."""
    if not 0.0 <= rate <= 1.0:
        raise InputError(f"noise.rate must be in [0, 1], got {rate}")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[noise_order(n)[: round(rate * n)]] = True
    return mask


def easy_donors(texts: list[str]) -> list[int]:
    """For each triplet, the triplet whose text replaces its own under easy noise: the next one along a
    fixed order whose text differs (itself only when every text is the same)."""
    n = len(texts)
    order = sorted(range(n), key=lambda i: (random.Random(derive_seed("triplet-donor", i)).random(), i))
    position = {i: p for p, i in enumerate(order)}
    donors = []
    for i in range(n):
        donor = i
        for step in range(1, n):
            candidate = order[(position[i] + step) % n]
            if texts[candidate] != texts[i]:
                donor = candidate
                break
        donors.append(donor)
    return donors


def tme_rows(n: int, rate: float) -> torch.Tensor:
    """(3, n) long: for the reference, the text and the target of each triplet, the triplet it takes that
    part from under TME noise at ``rate`` (the identity outside the noisy share)."""
    noisy = noise_order(n)[: round(rate * n)]
    k = len(noisy)
    cuts = (0, int(k / 3), int(2 * k / 3), k)
    rows = torch.arange(n).repeat(3, 1)
    for part in range(3):
        group = noisy[cuts[part] : cuts[part + 1]]
        shuffled = list(group)
        random.Random(derive_seed("triplet-tme", part, n, k)).shuffle(shuffled)
        rows[part, group] = torch.tensor(shuffled, dtype=torch.long)
    return rows


def image_noise_rows(n: int, rate: float, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(reference rows (n,), target rows (n,)) to index the image features with under ``kind`` noise;
    None when the kind leaves images alone (easy, hard)."""
    if kind != "tme":
        return None
    rows = tme_rows(n, rate)
    return rows[0], rows[2]


def inject_noise(texts: list[str], hard_texts: list[str | None] | None, rate: float, kind: str
                 ) -> tuple[list[str], torch.Tensor]:
    """(the training texts at ``rate`` of ``kind`` noise, (N,) bool noisy mask)."""
    if kind not in NOISE_KINDS:
        raise InputError(f"noise.kind must be one of {NOISE_KINDS}, got {kind!r}")
    mask = noisy_mask(len(texts), rate)
    if not bool(mask.any()):
        return list(texts), mask
    if kind == "tme":
        rows = tme_rows(len(texts), rate)
        return [texts[j] for j in rows[1].tolist()], (rows != torch.arange(len(texts))).any(0)
    if kind == "easy":
        donors = easy_donors(texts)
        noisy = [texts[donors[i]] if m else t for i, (t, m) in enumerate(zip(texts, mask.tolist()))]
    else:
        missing = [i for i, m in enumerate(mask.tolist()) if m and not (hard_texts and hard_texts[i])]
        if missing:
            raise InputError(f"noise.kind=hard needs a hard_modification for every noisy triplet; {len(missing)} "
                             f"lack one (e.g. triplet {missing[0]}); the toy triplets carry it, use noise.kind=easy "
                             "for other data")
        noisy = [hard_texts[i] if m else t for i, (t, m) in enumerate(zip(texts, mask.tolist()))]
    return noisy, mask
