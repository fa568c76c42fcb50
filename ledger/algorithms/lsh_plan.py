"""Planning a MinHash/LSH leakage screen within a review budget (seed 002 §15.4.3, exercise 8).

A corpus of ``N`` records has ``N (N - 1) / 2`` pairs: ``K`` true relatives at Jaccard
similarity ``s1`` and the rest unrelated at ``s0``.  A signature of ``n = b r`` components cut
into ``b`` bands of ``r`` rows makes a pair of similarity ``s`` a candidate with probability
``P(s) = 1 - (1 - s^r)^b`` (:func:`ledger.algorithms.minhash.candidate_probability`, computed
with ``log1p`` / ``expm1`` so that tiny probabilities keep their digits).  Per band design:

* expected false candidates ``(pairs - K) P(s0)`` and true candidates ``K P(s1)``;
* recall of true relatives ``P(s1)``;
* whether the expected candidates (false + true) fit the review budget;

and per signature length: the estimator's standard error ``sqrt(s (1 - s) / n)`` (at most
``0.5 / sqrt(n)``, at ``s = 0.5``), bytes per signature ``n * bytes_per_value`` and per
corpus ``N`` times that.  Exercise 8 (100,000 records, 128 components of 4 bytes, 2,000
relatives at 0.8, the rest at 0.1, 20,000 pairs of budget): 32x4 gives ~1.6e7 false
candidates (over budget), 16x8 ~800, 8x16 4.0e-6 (the naive ``1 - (1 - s**r)**b`` in floating
point gives 4.4e-6 there: ``1 - 1e-16`` rounds to ``1 - 1.11e-16``); 512 B per signature,
51.2 MB per corpus, standard error at most 0.0442.

Pure functions over numbers: no I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ledger.algorithms.errors import InputError
from ledger.algorithms.minhash import candidate_probability, steepest_similarity

__all__ = ["BandDesign", "ScreenPlan", "band_designs", "standard_error", "plan_screen"]


@dataclass(frozen=True)
class BandDesign:
    """One banding of the signature and what it costs in review."""

    bands: int
    rows: int
    threshold: float
    """``(1/b)^(1/r)``: where the candidate curve is steepest."""
    false_candidates: float
    recall: float
    true_candidates: float
    expected_candidates: float
    fits_budget: bool | None
    """``None`` without a budget."""


@dataclass(frozen=True)
class ScreenPlan:
    records: int
    pairs: int
    relatives: int
    unrelated_pairs: int
    similarity_of_unrelated: float
    similarity_of_relatives: float
    budget: int | None
    num_perm: int
    bytes_per_value: int
    bytes_per_signature: int
    bytes_per_corpus: int
    standard_error_max: float
    standard_error_relatives: float
    standard_error_unrelated: float
    designs: tuple[BandDesign, ...]


def band_designs(num_perm: int) -> list[tuple[int, int]]:
    """Every ``(bands, rows)`` with ``bands * rows == num_perm``, most bands first."""
    if num_perm < 1:
        raise InputError("num_perm must be >= 1")
    return [(b, num_perm // b) for b in range(num_perm, 0, -1) if num_perm % b == 0]


def standard_error(s: float, num_perm: int) -> float:
    """``sqrt(s (1 - s) / n)``: the standard error of the MinHash estimate of a similarity ``s``."""
    if num_perm < 1:
        raise InputError("num_perm must be >= 1")
    if not 0.0 <= s <= 1.0:
        raise InputError("similarity must lie in [0, 1]")
    return math.sqrt(s * (1.0 - s) / num_perm)


def _design(b: int, r: int, unrelated: int, relatives: int, s0: float, s1: float, budget: int | None) -> BandDesign:
    false = unrelated * float(candidate_probability(s0, b, r))
    recall = float(candidate_probability(s1, b, r))
    expected = false + relatives * recall
    return BandDesign(bands=b, rows=r, threshold=steepest_similarity(b, r), false_candidates=false, recall=recall,
                      true_candidates=relatives * recall, expected_candidates=expected,
                      fits_budget=None if budget is None else expected <= budget)


def plan_screen(
    records: int,
    budget: int | None = None,
    *,
    similarity_of_unrelated: float = 0.1,
    similarity_of_relatives: float = 0.8,
    relatives: int = 0,
    num_perm: int = 128,
    bytes_per_value: int = 4,
    designs: list[tuple[int, int]] | None = None,
) -> ScreenPlan:
    """The review load of every band design (default: every ``b x r == num_perm``)."""
    if records < 0:
        raise InputError("records must be >= 0")
    if budget is not None and budget < 0:
        raise InputError("budget must be >= 0")
    if bytes_per_value < 1:
        raise InputError("bytes per value must be >= 1")
    pairs = records * (records - 1) // 2
    if not 0 <= relatives <= pairs:
        raise InputError(f"relatives must be between 0 and the {pairs} pairs of {records} records")
    for s in (similarity_of_unrelated, similarity_of_relatives):
        if not 0.0 <= s <= 1.0:
            raise InputError("similarity must lie in [0, 1]")
    designs = band_designs(num_perm) if designs is None else designs
    for b, r in designs:
        if b < 1 or r < 1 or b * r > num_perm:
            raise InputError(f"{b} bands x {r} rows needs b, r >= 1 and b*r <= num_perm ({num_perm})")
    unrelated = pairs - relatives
    per_sig = num_perm * bytes_per_value
    return ScreenPlan(
        records=records, pairs=pairs, relatives=relatives, unrelated_pairs=unrelated,
        similarity_of_unrelated=similarity_of_unrelated, similarity_of_relatives=similarity_of_relatives,
        budget=budget, num_perm=num_perm, bytes_per_value=bytes_per_value, bytes_per_signature=per_sig,
        bytes_per_corpus=records * per_sig, standard_error_max=standard_error(0.5, num_perm),
        standard_error_relatives=standard_error(similarity_of_relatives, num_perm),
        standard_error_unrelated=standard_error(similarity_of_unrelated, num_perm),
        designs=tuple(_design(b, r, unrelated, relatives, similarity_of_unrelated, similarity_of_relatives, budget)
                      for b, r in designs))
