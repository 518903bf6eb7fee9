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

import math
from dataclasses import dataclass, field

import numpy as np

from trt_spec.runtime.speculation.policy import PROBE_EVERY, probes

BINS = 10
PRIOR_WEIGHT = 4.0  # pseudo-observations at a(conf) = conf per bin
# c(T) / c(1) until measured: exact decoding on the int4 CPU engine (past 64), then +0.23 a row
PRIOR_COST = (1.00, 1.02, 1.21, 1.38, 1.62)
PRIOR_DRAFT = 0.07  # one drafter step / c(1)
MIN_SAMPLES = 8  # step timings of a size before its running mean replaces the prior
DECAY = 0.05  # running means: weight of the newest sample
POSITION_DECAY = 0.01  # acceptance by position: weight of the newest step (~100 steps)
PRIOR_ACCEPTANCE = 0.8  # per position, until measured: optimistic, so it gets measured
PRIOR_COUNT = 1.0  # ... and what that prior weighs once measured, in verified steps


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
    """Running means of a target step by (streams decoding, rows), and of one drafter step by
    method (seconds). Costs are relative to c_B(1), the plain step of the same batch B: a
    batch of B streams that does not draft emits B tokens for c_B(1), so a stream's step pays
    when its tokens exceed c_B(rows) / c_B(1). The engine measures a batch's curve once
    (`known`, `record`: cost_probe.py) before it relies on it; live steps then refine it.
    A step also spends time around the forward (sampling, verification, bookkeeping: o_B,
    measured on every step), plain or not, so the ratios are (c_B(T) + o_B) / (c_B(1) + o_B):
    without it a drafted row looks dearer than it is against a whole plain step; o_B is
    measured on plain steps (a verifying step's sample phase does more).
    The curve still misses what a drafting step spends around its forward: verifying k + 1
    rows, a head's bookkeeping of the target's rows, the plan itself. So each drafter's steps
    are also timed (all but the drafting, which is timed per token apart) and kept as a
    running ratio to the curve's (c_B(T) + o_B) (`observe_measured`); `step_cost` multiplies
    the curve's part by it (`correction`, 1 until measured), so every rule that weighs a
    drafting step weighs what it takes on this machine, under this load, on this workload.
    (The drafting stays apart: a head that sat out catches up when it probes, and that
    one-off cost would otherwise price its every later step.)"""

    def __init__(self):
        self.step: dict[tuple[int, int], tuple[float, int]] = {}  # (B, T) -> (mean s, n)
        self.draft: dict[str, tuple[float, int]] = {}  # method -> (mean seconds a token, n)
        self.overhead: dict[int, tuple[float, int]] = {}  # B -> (mean seconds a plain step, n)
        self.overhead_any: dict[int, tuple[float, int]] = {}  # B -> (the same, every step)
        # (drafter, B) -> (mean wall time / model cost of its drafting steps, n); drafter None:
        # any lookup (what a picking proposer asks a lookup's cost as)
        self.measured: dict[tuple[str | None, int], tuple[float, int]] = {}
        self.corrected = True  # whether step_cost applies the measured ratio
        # (B, T) -> a probe's seconds, and the live steps of that size since: a width the
        # rules then never run keeps the probe's ratio to its c_B(1), not its seconds (the
        # probe may have run under another load than the live plain steps that follow)
        self.probed: dict[tuple[int, int], float] = {}
        self.live: dict[tuple[int, int], int] = {}
        self._units: dict[int, float | None] = {}  # _unit by batch, until a cost changes

    @staticmethod
    def _update(table: dict, key, seconds: float) -> None:
        mean, n = table.get(key, (seconds, 0))
        w = max(DECAY, 1.0 / (n + 1))
        table[key] = ((1 - w) * mean + w * seconds, n + 1)

    def observe_step(self, batch: int, rows: int, seconds: float) -> None:
        self._update(self.step, (batch, rows), seconds)
        self.live[(batch, rows)] = self.live.get((batch, rows), 0) + 1
        self._units.pop(batch, None)

    def observe_overhead(self, batch: int, seconds: float, plain: bool = True) -> None:
        """Seconds a step spent outside the forward and the drafting (plain: no stream
        drafted; the unit is a plain step's)."""
        self._update(self.overhead_any, batch, seconds)
        if plain:
            self._update(self.overhead, batch, seconds)
        self._units.pop(batch, None)

    def observe_measured(self, drafter: str | None, batch: int, rows: int,
                         seconds: float) -> None:
        """A step of `rows` rows in which `drafter` drafted took `seconds` past its drafting,
        where the curve says ratio(rows) plain steps."""
        unit = self._unit(batch)
        if unit is not None:
            self._update(self.measured, (drafter, batch),
                         seconds / (self.ratio(rows, batch) * unit))

    def correction(self, drafter: str | None, batch: int = 1) -> float:
        """What `drafter`'s steps take against what the model says (1 until measured)."""
        mean, n = self.measured.get((drafter, batch), (1.0, 0))
        return mean if self.corrected and n >= MIN_SAMPLES else 1.0

    def plain_seconds(self, batch: int) -> float | None:
        """A plain step's seconds at this batch size, c_B(1) + o_B (None: not measured)."""
        return self._unit(batch)

    def observe_draft(self, method: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self._update(self.draft, method, seconds / tokens)

    def record(self, batch: int, rows: int, seconds: float) -> None:
        """A measured cost (a probe's median): counts as MIN_SAMPLES live steps."""
        self.step[(batch, rows)] = (seconds, MIN_SAMPLES)
        self.probed[(batch, rows)], self.live[(batch, rows)] = seconds, 0
        self._units.pop(batch, None)

    def known(self, batch: int) -> bool:
        """Whether c_B(1) is measured for this batch size."""
        return self.step.get((batch, 1), (0.0, 0))[1] >= MIN_SAMPLES

    def _overhead(self, batch: int) -> float:
        """o_B of plain steps; of every step until a plain one is measured."""
        return self.overhead.get(batch, self.overhead_any.get(batch, (0.0, 0)))[0]

    def _unit(self, batch: int) -> float | None:
        """A plain step in seconds, c_B(1) + o_B: c_B(1) measured, else from the batch's
        smallest measured step and the prior ratio (kept until a cost of the batch changes:
        a step's plan reads it for every stream and length)."""
        if batch not in self._units:
            self._units[batch] = self._measure_unit(batch)
        return self._units[batch]

    def _measure_unit(self, batch: int) -> float | None:
        known = [(t, m) for (b, t), (m, n) in self.step.items() if b == batch and n >= MIN_SAMPLES]
        if not known:
            return None
        t, mean = min(known)
        return mean / prior_cost(t) + self._overhead(batch)

    def ratio(self, t: int, batch: int = 1) -> float:
        """(c_B(t) + o_B) / (c_B(1) + o_B)."""
        unit = self._unit(batch)
        mean, n = self.step.get((batch, t), (0.0, 0))
        if unit is None or n < MIN_SAMPLES:
            return prior_cost(t)
        return (self._current(batch, t, mean) + self._overhead(batch)) / unit

    def _current(self, batch: int, t: int, mean: float) -> float:
        """c_B(t) now: its running mean, or where only its probe timed it (fewer than
        MIN_SAMPLES live steps since), the probe's c_B(t) / c_B(1) times c_B(1) now."""
        probe, probe_1 = self.probed.get((batch, t)), self.probed.get((batch, 1))
        if t == 1 or probe is None or not probe_1 or self.live.get((batch, t), 0) >= MIN_SAMPLES:
            return mean
        return probe / probe_1 * self.step[(batch, 1)][0]

    def draft_ratio(self, method: str, batch: int = 1) -> float:
        unit = self._unit(batch)
        mean, n = self.draft.get(method, (0.0, 0))
        if unit is None or n < MIN_SAMPLES:
            return PRIOR_DRAFT
        return mean / unit

    def step_cost(self, method: str | None, rows: int, drafted: int, batch: int = 1) -> float:
        """A step verifying `rows` rows after `drafted` drafted tokens (all streams'), in
        plain steps c_B(1) (method None: a lookup, whose drafting is free); the curve's
        part corrected by what the method's drafting steps measured."""
        draft = self.draft_ratio(method, batch) if method is not None else 0.0
        curve = self.ratio(rows, batch) * (self.correction(method, batch) if rows > 1 else 1)
        return curve + drafted * draft

    def marginal(self, method: str | None, drafted: int, batch: int = 1) -> float:
        """The cost of drafting token drafted+1, in plain decoding steps (method None: a
        lookup, whose drafting is free)."""
        t = drafted + 1  # rows verified now: the last token and the drafts
        draft = self.draft_ratio(method, batch) if method is not None else 0.0
        return max(self.ratio(t + 1, batch) - self.ratio(t, batch), 0.0) + draft


class DraftLength:
    """The rule above, shared by every stream of an engine."""

    def __init__(self):
        self.costs = StepCosts()
        self.margin = 0.0  # what a model drafter's gain must exceed 1 by (the policy's)
        self.calibration: dict[str, Calibration] = {}
        self.positions: dict[tuple[str, bool], PositionAcceptance] = {}  # (method, sampled)

    def acceptance(self, method: str, sampled: bool) -> PositionAcceptance:
        found = self.positions.get((method, sampled))  # (asked a few times a step: made once)
        if found is None:
            found = self.positions[(method, sampled)] = PositionAcceptance()
        return found

    def calib(self, method: str) -> Calibration:
        found = self.calibration.get(method)
        if found is None:
            found = self.calibration[method] = Calibration()
        return found

    def gate(self, method: str, adaptive: list[bool], batch: int = 1) -> "DraftGate":
        """batch: the streams decoding in this step (what the costs are measured at)."""
        return DraftGate(self, method, adaptive, batch, drafter=method)

    def plan(self, key: str, drafter: str, k_max: int, batch: int = 1) -> int:
        """How many tokens `drafter` drafts before drafting, from acceptance by position
        (calibration `key`): for drafters whose cost depends on how regularly each position
        is drafted (MTP: module i catches up on every row it skipped, so a per-step stop
        costs more later)."""
        return self._by_position(key, drafter, k_max, True, batch)[0]

    def cut(self, key: str, tokens, adaptive: bool, batch: int = 1
            ) -> tuple[object, list[float]]:
        """A lookup's draft (n-gram, suffix: no confidence) cut where the next token no longer
        pays, with acceptance calibrated by position instead (calibration `key`) -> (the
        tokens kept, the pseudo-confidences to calibrate with)."""
        n, confidences = self._by_position(key, None, len(tokens), adaptive, batch)
        return tokens[:n], confidences

    def _by_position(self, key: str, drafter: str | None, n: int, adaptive: bool, batch: int
                     ) -> tuple[int, list[float]]:
        """Of n positions, how many pay (the first always does), and their pseudo-confidences
        (drafter None: a lookup, drafting for free)."""
        gate = DraftGate(self, key, [adaptive], batch, drafter)
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

    def __init__(self, rule: DraftLength, method: str, adaptive: list[bool], batch: int,
                 drafter: str | None):
        """method: the calibration key; drafter: the method whose drafter step each token
        costs (None: drafting is free, a lookup); batch: the streams decoding in this
        step."""
        self.rule = rule
        self.method = method
        self.drafter = drafter
        self.adaptive = adaptive
        self.batch = batch
        self.confidences: list[list[float]] = [[] for _ in adaptive]
        self.gain = [1.0] * len(adaptive)
        self.calib = rule.calib(method)

    def more(self, i: int, conf: float) -> bool:
        """gain[i]: P(every draft so far accepted); the next one is expected to be accepted
        as often as this one (a drafter's confidence runs in stretches). A confidence that is
        not a finite number (a drafter's NaN) stops the stream's drafting (the planner then
        drops its draft: Draft.finite)."""
        self.confidences[i].append(float(conf))
        if not math.isfinite(conf):
            return False
        if not self.adaptive[i]:
            return True
        rate = self.calib.rate(conf)
        self.gain[i] *= rate
        drafted = len(self.confidences[i])
        return self.gain[i] * rate >= self.rule.costs.marginal(self.drafter, drafted, self.batch)

    def skips(self, skipped: dict, key, gain: float) -> bool:
        """The policy's gain rule for a proposer that picks its own length (suffix, hybrid,
        auto): a step where no length pays (gain < 1) is counted in skipped[key] (the
        proposer's, cleared at its release), and drafts nothing but for the policy's probes
        (policy.py: probes), so the measurements follow the workload."""
        skipped[key] = skipped.get(key, 0) + 1
        return not probes(skipped[key], gain)


class PositionAcceptance:
    """How often a method's draft at position j is accepted, given it was verified (decayed
    counts, so it follows the workload): what a step of k drafts is expected to emit,
    1 + sum_j P(d_1..d_j accepted). Engine-wide, per method and sampling mode, so a new
    request starts from what earlier ones measured. Before anything is measured a position
    is assumed to pay (PRIOR_ACCEPTANCE), so speculation is tried and measured."""

    def __init__(self):
        self.proposed: list[float] = []
        self.accepted: list[float] = []
        self.shortened = 0  # steps `longer` was asked about whose best length was cut short

    def observe(self, proposed: int, accepted: int) -> None:
        while len(self.proposed) < proposed:
            self.proposed.append(0.0)
            self.accepted.append(0.0)
        for j in range(proposed):
            self.proposed[j] = self.proposed[j] * (1 - POSITION_DECAY) + 1
            self.accepted[j] = self.accepted[j] * (1 - POSITION_DECAY) + (j < accepted)

    def rate(self, j: int) -> float:
        """P(d_1..d_{j+1} accepted): drafts 0..j all accepted. Position by position, each
        measure has a prior that weighs as PRIOR_COUNT steps, at PRIOR_ACCEPTANCE times the
        rate up to the position before (1 before the first), and is no more likely than that
        rate; a position never verified has its prior alone (drafting it is then tried
        through `longer`). So a position rejected the few times it was verified is tried
        again while that share still pays: with the measured rate alone one rejection would
        close it for good, as a closed position is never verified again (a source's first
        rejection, before any acceptance, would leave it to the policy's rare probes for the
        rest of the engine's life)."""
        rate = 1.0
        for i in range(j + 1):
            if i >= len(self.proposed):  # never verified: the prior alone
                rate *= PRIOR_ACCEPTANCE
            else:
                rate = min((self.accepted[i] + PRIOR_COUNT * rate * PRIOR_ACCEPTANCE)
                           / (self.proposed[i] + PRIOR_COUNT), rate)
        return rate

    def expected_tokens(self, k: int) -> float:
        """Tokens a step of k drafts emits on average (the bonus token included)."""
        return 1 + sum(self.rate(j) for j in range(k))

    def best(self, costs: StepCosts, method: str, k: int, batch: int, drafters: int = 1
             ) -> tuple[int, float]:
        """(j, gain) for the j in 1..k with the most expected tokens per unit of cost (plain
        decoding: 1) at this batch size, `drafters` streams of it drafting j each (every
        stream waits for the whole step: its cost is the step's)."""
        best_j, best_gain, tokens = 1, 0.0, 1.0
        for j in range(1, k + 1):
            tokens += self.rate(j - 1)
            gain = tokens / costs.step_cost(method, j + 1, drafters * j, batch)
            if gain > best_gain:
                best_j, best_gain = j, gain
        return best_j, best_gain

    def longer(self, best: int, n: int) -> int:
        """The length to draft of n found, `best` being what pays by this measure: one more
        on every PROBE_EVERY-th step that `best` cuts short, so the position past the cut
        stays measured (without it an early rejection there would fix the cut for good:
        an unverified position is never measured again)."""
        if best >= n:
            return best
        self.shortened += 1
        return best + 1 if self.shortened % PROBE_EVERY == 0 else best

    def gain(self, costs: StepCosts, method: str, k: int, batch: int, drafters: int = 1,
             best_of: bool = False) -> float:
        """Expected tokens per unit of cost of drafting k (best_of: the best k' <= k)."""
        if best_of:
            return self.best(costs, method, k, batch, drafters)[1]
        return self.expected_tokens(k) / costs.step_cost(method, k + 1, drafters * k, batch)
