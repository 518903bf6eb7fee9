"""How far to draft (`--num-draft-tokens auto`): a drafted token must pay for itself.

Drafting token j+1 (after j drafts) gains the tokens it adds when accepted, and costs one more
drafter step plus one more verified row:

    gain(j+1) = P(d_1 .. d_{j+1} all accepted) ~ prod_i a(conf_i)
    cost(j+1) = (c(j+2) - c(j+1)) / c(1) + draft / c(1)          (in plain decoding steps)
    draft d_{j+1} while gain(j+1) >= cost(j+1), up to the request's maximum K

conf_i is the drafter's probability of the token it drafted; a(conf) is the acceptance rate
measured at that confidence (calibration: per method, in confidence bins, starting from
a(conf) = conf). c(T), a target step of T rows, and `draft`, one drafter step, are measured
from the engine's own steps (running means; a prior curve until there are enough). So the
rule is per engine, per method, and it adapts while it runs. A gain below the cost means the
marginal token earns less than a plain decoding step would: stopping there maximises tokens
per unit of time. (Cf. the dynamic draft lengths of EAGLE-2 and of vLLM / TensorRT-LLM.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

BINS = 10
PRIOR_WEIGHT = 4.0  # pseudo-observations at a(conf) = conf per bin
# c(T) / c(1) until measured: exact decoding on the int4 CPU engine (past 64), then +0.23 a row
PRIOR_COST = (1.00, 1.02, 1.21, 1.38, 1.62)
PRIOR_DRAFT = 0.07  # one drafter step / c(1)
MIN_SAMPLES = 8  # step timings of a size before its running mean replaces the prior
DECAY = 0.05  # running means: weight of the newest sample


def prior_cost(t: int) -> float:
    if t <= len(PRIOR_COST):
        return PRIOR_COST[t - 1]
    return PRIOR_COST[-1] + 0.23 * (t - len(PRIOR_COST))


@dataclass
class Calibration:
    """Acceptance rate by drafter confidence, for one method."""

    proposed: np.ndarray = field(default_factory=lambda: np.full(BINS, PRIOR_WEIGHT))
    accepted: np.ndarray = field(default_factory=lambda: PRIOR_WEIGHT
                                 * (np.arange(BINS) + 0.5) / BINS)

    @staticmethod
    def bin(conf: float) -> int:
        return min(int(conf * BINS), BINS - 1)

    def rate(self, conf: float) -> float:
        b = self.bin(conf)
        return float(self.accepted[b] / self.proposed[b])

    def observe(self, confidences: list[float], num_accepted: int) -> None:
        """Drafts d_1.. with these confidences; the first num_accepted were accepted (so d_i
        was judged for i <= num_accepted + 1; later ones were never verified)."""
        for i, conf in enumerate(confidences[:num_accepted + 1]):
            b = self.bin(conf)
            self.proposed[b] += 1
            self.accepted[b] += i < num_accepted


class StepCosts:
    """Running means of a target step by rows, and of one drafter step by method (seconds)."""

    def __init__(self):
        self.step: dict[int, tuple[float, int]] = {}  # T -> (mean seconds, samples)
        self.draft: dict[str, tuple[float, int]] = {}  # method -> (mean seconds a token, n)

    @staticmethod
    def _update(table: dict, key, seconds: float) -> None:
        mean, n = table.get(key, (seconds, 0))
        w = max(DECAY, 1.0 / (n + 1))
        table[key] = ((1 - w) * mean + w * seconds, n + 1)

    def observe_step(self, rows: int, seconds: float) -> None:
        self._update(self.step, rows, seconds)

    def observe_draft(self, method: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._update(self.draft, method, seconds / tokens)

    def _unit(self) -> float | None:
        """c(1) in seconds, from the smallest measured step size and the prior ratio."""
        known = [(t, m) for t, (m, n) in self.step.items() if n >= MIN_SAMPLES]
        if not known:
            return None
        t, mean = min(known)
        return mean / prior_cost(t)

    def ratio(self, t: int) -> float:
        """c(t) / c(1)."""
        unit = self._unit()
        mean, n = self.step.get(t, (0.0, 0))
        if unit is None or n < MIN_SAMPLES:
            return prior_cost(t)
        return mean / unit

    def draft_ratio(self, method: str) -> float:
        unit = self._unit()
        mean, n = self.draft.get(method, (0.0, 0))
        if unit is None or n < MIN_SAMPLES:
            return PRIOR_DRAFT
        return mean / unit

    def step_cost(self, method: str, rows: int, drafted: int) -> float:
        """A step verifying `rows` rows after `drafted` drafter steps, in plain steps c(1)."""
        return self.ratio(rows) + drafted * self.draft_ratio(method)

    def marginal(self, method: str, drafted: int) -> float:
        """The cost of drafting token drafted+1, in plain decoding steps."""
        t = drafted + 1  # rows verified now: the last token and the drafts
        return max(self.ratio(t + 1) - self.ratio(t), 0.0) + self.draft_ratio(method)


class DraftLength:
    """The rule above, shared by every stream of an engine."""

    def __init__(self):
        self.costs = StepCosts()
        self.calibration: dict[str, Calibration] = {}

    def calib(self, method: str) -> Calibration:
        return self.calibration.setdefault(method, Calibration())

    def gate(self, method: str, adaptive: list[bool]) -> "DraftGate":
        return DraftGate(self, method, adaptive)

    def plan(self, key: str, k_max: int) -> int:
        """How many tokens to draft before drafting, from acceptance by position (calibration
        `key`): for drafters whose cost depends on how regularly each position is drafted
        (MTP: module i catches up on every row it skipped, so a per-step stop costs more
        later)."""
        return self._by_position(key, k_max, True)[0]

    def cut(self, key: str, tokens, adaptive: bool) -> tuple[object, list[float]]:
        """A lookup's draft (n-gram, suffix: no confidence) cut where the next token no longer
        pays, with acceptance calibrated by position instead (calibration `key`) -> (the
        tokens kept, the pseudo-confidences to calibrate with)."""
        n, confidences = self._by_position(key, len(tokens), adaptive)
        return tokens[:n], confidences

    def _by_position(self, key: str, n: int, adaptive: bool) -> tuple[int, list[float]]:
        """Of n positions, how many pay (the first always does), and their pseudo-confidences."""
        gate = DraftGate(self, key, [adaptive])
        for j in range(n):
            if not gate.more(0, position_confidence(j)):
                return j + 1, gate.confidences[0]
        return n, gate.confidences[0]


def position_confidence(j: int) -> float:
    """The calibration bin of draft position j (0-based) for drafters without a confidence:
    position 0 in the top bin, then one bin lower a position (prior a = 0.95, 0.85, ...)."""
    return (BINS - 1 - min(j, BINS - 1) + 0.5) / BINS


class DraftGate:
    """One proposer call's decisions: `more(i, conf)` after stream i's draft of that
    confidence says whether to draft another; the confidences are kept for calibration."""

    def __init__(self, rule: DraftLength, method: str, adaptive: list[bool]):
        self.rule = rule
        self.method = method
        self.adaptive = adaptive
        self.confidences: list[list[float]] = [[] for _ in adaptive]
        self.gain = [1.0] * len(adaptive)
        self.calib = rule.calib(method)

    def more(self, i: int, conf: float) -> bool:
        """gain[i]: P(every draft so far accepted); the next one is expected to be accepted
        as often as this one (a drafter's confidence runs in stretches)."""
        self.confidences[i].append(float(conf))
        if not self.adaptive[i]:
            return True
        rate = self.calib.rate(conf)
        self.gain[i] *= rate
        drafted = len(self.confidences[i])
        return self.gain[i] * rate >= self.rule.costs.marginal(self.method, drafted)
