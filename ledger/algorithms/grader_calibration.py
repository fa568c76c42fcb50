"""Grader calibration against adequate and inadequate controls (SPEC §6.10, seed 002 §15.3.2).
Pure functions, no I/O.

An evaluator version's **observed** verdict on a control is its first decisive assessment of
the control execution: ``pass`` when scored with reward >= 1.0, otherwise ``fail`` (a lower
reward or ``not_assessable``); ``None`` until it has assessed the control.

An evaluator version is **calibrated** when it has at least one adequate and one inadequate
control, has assessed every one of them, classified each as expected, and no control is
declared twice with different expectations.

Rates (``None`` when nothing to divide by): false acceptance = inadequate controls observed
``pass`` / inadequate controls observed; false rejection = adequate controls observed ``fail``
/ adequate controls observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["PASS_REWARD", "Calibration", "Control", "calibrate", "observed_verdict"]

PASS_REWARD = 1.0


@dataclass(frozen=True)
class Control:
    execution_id: str
    kind: str  # adequate | inadequate
    expected: str  # pass | fail
    observed: str | None  # pass | fail | None (not yet assessed)


@dataclass(frozen=True)
class Calibration:
    evaluator: str
    controls: tuple[Control, ...]
    misclassified: tuple[str, ...]
    unassessed: tuple[str, ...]
    conflicting: tuple[str, ...]
    missing_kinds: tuple[str, ...]
    false_acceptance: tuple[int, int]  # (inadequate passed, inadequate observed)
    false_rejection: tuple[int, int]  # (adequate failed, adequate observed)

    @property
    def calibrated(self) -> bool:
        return not (self.misclassified or self.unassessed or self.conflicting or self.missing_kinds)

    @property
    def false_acceptance_rate(self) -> float | None:
        k, n = self.false_acceptance
        return k / n if n else None

    @property
    def false_rejection_rate(self) -> float | None:
        k, n = self.false_rejection
        return k / n if n else None

    def why_not(self) -> str:
        """Why the evaluator is not calibrated ("" when it is)."""
        parts = []
        if self.missing_kinds:
            parts.append("no " + " and no ".join(self.missing_kinds) + " control")
        if self.misclassified:
            parts.append("misclassified controls " + ", ".join(self.misclassified))
        if self.conflicting:
            parts.append("conflicting control declarations for " + ", ".join(self.conflicting))
        if self.unassessed:
            parts.append("controls not yet assessed " + ", ".join(self.unassessed))
        return "; ".join(parts)


def observed_verdict(outcome: str | None, reward: float | None) -> str | None:
    """The verdict a first decisive assessment gives a control (``None``: no decisive assessment)."""
    if outcome is None:
        return None
    return "pass" if outcome == "scored" and reward is not None and reward >= PASS_REWARD else "fail"


def calibrate(evaluator: str, declarations: Iterable[tuple[str, str, str]],
              observed: dict[str, str | None]) -> Calibration:
    """``declarations``: ``(control execution id, kind, expected)`` (a control may be declared more
    than once); ``observed``: control execution id -> observed verdict (or ``None``)."""
    by_ex: dict[str, set[tuple[str, str]]] = {}
    for ex, kind, expected in declarations:
        by_ex.setdefault(ex, set()).add((kind, expected))
    controls, conflicting = [], []
    for ex in sorted(by_ex):
        decl = sorted(by_ex[ex])
        if len(decl) > 1:
            conflicting.append(ex)
        kind, expected = decl[0]
        controls.append(Control(ex, kind, expected, observed.get(ex)))
    mis = tuple(c.execution_id for c in controls if c.observed is not None and c.observed != c.expected)
    unassessed = tuple(c.execution_id for c in controls if c.observed is None)
    kinds = {c.kind for c in controls}
    missing = tuple(k for k in ("adequate", "inadequate") if k not in kinds)
    inad = [c for c in controls if c.kind == "inadequate" and c.observed is not None]
    adeq = [c for c in controls if c.kind == "adequate" and c.observed is not None]
    return Calibration(evaluator, tuple(controls), mis, unassessed, tuple(conflicting), missing,
                       (sum(c.observed == "pass" for c in inad), len(inad)),
                       (sum(c.observed == "fail" for c in adeq), len(adeq)))
