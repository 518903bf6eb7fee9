"""When to speculate: RTP-LLM's force_disable_sp_run, generalised into configurable rules.

`plan(streams)` decides, for one step, how many tokens each stream drafts (0 = a plain
decode step for that stream, in the same target forward as the others):
    - the stream's method is none (or its request asked for no speculation)  -> 0
    - more streams are decoding than `spec_max_batch`                         -> 0 for all
      (the batch already keeps the CPU busy; verifying k+1 tokens per stream costs more
      than it saves)
    - the stream's acceptance rate over its last `window` speculative steps fell below
      `min_acceptance`                                   -> 0 for `cooldown` steps, then it
      tries again (the condition clears when acceptance recovers)
    - the method's expected tokens per unit of cost at its best k' <= k (engine-wide
      acceptance by position, costs measured at this batch size and corrected by what
      the method's steps measured whole: draft_length.PositionAcceptance, StepCosts) is
      below 1 + `margin`, plain decoding's and a margin for the estimate's error -> 0, but the
      first such step of a request and every `PROBE_EVERY`-th after it draft k' (the
      best length, however short of paying), so the measurements follow the workload; a
      gain below SURE_LOSS probes 4x less often, and not on the first step (`fallback`)
    - else, a fixed k whose best k' is shorter                             -> k' (k is the
      most a step drafts: the later positions would cost more than they add), but the
      first such step of a request and every `PROBE_EVERY`-th after it draft k' + 1, so
      the next position stays measured (`fallback`; an `auto` stream picks its own length)
  A probe drafts one position past what pays, not all k: P(d_1..d_j accepted) falls with j
  while each verified row costs about the same, so where position k' + 1 does not pay the
  later ones do not either, and a probe of all k costs a weak drafter ~4% of its steps.
    - a speculating stream whose tokens per unit of cost over its last `window` steps fell
      below 1 + `margin` (plain decoding would have been faster, or about as fast; a step's
      cost is its whole wall time over a plain step's, measured at the batch size decoding,
      runtime/speculation/cost_probe.py)  -> 0 for `cooldown` steps, then it probes again;
      a probe that fails again doubles the cooldown (up to `max_cooldown`), one that
      pays resets it (`fallback`; on by default)
    - else its k, capped by the tokens still allowed and the room left in the cache.
A request's k, the default or its own, is the most a step drafts, not a promise: under the
gain rules the policy drafts less, down to none, where more does not pay (`fallback=False`,
`--no-spec-fallback`: exactly k on every step). The gain rules (`fallback`) apply to every
request, seeded sampled ones too: a sampled token is a function of the seed and its output
position alone (runtime/race.py), so what the rules decide (timings, what earlier requests measured) never changes the output.
The policy keeps its own per-stream state (the windows and the cooldown), by stream id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from trt_spec.runtime.settings import SpeculationConfig

PROBE_EVERY = 16  # of the steps the expected gain says to skip, one in this many drafts
# An expected gain this far below plain decoding's is a measured loss (the optimistic prior
# never says so): probes then come SURE_LOSS_SPACING times less often, and not on a request's
# first skipped step. A drafter with a cache of its own (the draft model) catches up on every
# token it skipped when it probes, the first probe of a request on its whole prompt: at batch
# 2-4 those catch-ups cost 5-8% of decoding where the drafter never paid.
SURE_LOSS = 0.9
SURE_LOSS_SPACING = 4


@dataclass
class _StreamState:
    window: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted)
    gains: list[tuple[int, float]] = field(default_factory=list)  # (emitted, cost in c(1))
    cooldown: int = 0  # plain steps left before drafting again
    losses: int = 0  # gain windows lost in a row (each doubles the next cooldown)
    probing: bool = False  # the first gain window since a cooldown
    skipped: int = 0  # steps the expected gain said not to draft
    shortened: int = 0  # steps it said to draft fewer tokens than k


def probes(skipped: int, gain: float) -> bool:
    """Whether the `skipped`-th step that the expected gain says to skip drafts anyway: the
    first and one in PROBE_EVERY, or where the gain is a sure loss, one in
    PROBE_EVERY * SURE_LOSS_SPACING (the first not among them)."""
    if gain >= SURE_LOSS:
        return skipped % PROBE_EVERY == 1
    return skipped % (PROBE_EVERY * SURE_LOSS_SPACING) == 0


class SpeculationPolicy:
    def __init__(self, config: SpeculationConfig, max_len: int):
        self.config = config
        self.max_len = max_len
        self._state: dict[int, _StreamState] = {}

    def room(self, s) -> int:
        """The most tokens `s` may draft now: below its remaining max_tokens and cache rows."""
        remaining = s.params.max_tokens - len(s.output_ids)  # tokens still allowed
        cached = len(s.prompt_ids) + len(s.output_ids) - 1  # rows the target cache holds
        room = self.max_len - cached - 1  # rows left after the last token's
        return max(0, min(remaining - 1, room))

    def plan(self, streams: list, gain: Callable[[object, int], tuple[int, float]] | None = None
             ) -> list[int]:
        """Tokens to draft per stream this step; counts down the cooldowns it passes.
        gain(s, k) -> (k', g): the draft length at most k that s does best with now, and the
        tokens per unit of cost it can expect from it (None: not known)."""
        c = self.config
        over = c.spec_max_batch is not None and len(streams) > c.spec_max_batch
        ks = []
        for s in streams:
            st = self._state.get(s.id)
            if s.num_draft_tokens == 0 or over:
                ks.append(0)
            elif st is not None and st.cooldown > 0:
                st.cooldown -= 1
                ks.append(0)
            else:
                k = min(s.num_draft_tokens, self.room(s))
                if k and self.judged(s) and gain is not None:
                    best, g = gain(s, k)
                    st = self._state.setdefault(s.id, _StreamState())
                    if g < 1 + c.margin:
                        st.skipped += 1  # the first such step of a request probes too
                        k = min(k, best) if probes(st.skipped, g) else 0
                    elif best < k:
                        st.shortened += 1  # ... and drafts one position more
                        k = min(k, best + 1) if st.shortened % PROBE_EVERY == 1 else best
                ks.append(k)
        return ks

    def judged(self, s) -> bool:
        """Whether the gain rules apply to s (see the module's docstring)."""
        return self.config.fallback

    def observe(self, s, proposed: int, accepted: int, cost: float | None = None) -> None:
        """Records a step (cost: what the whole step cost, in plain decoding steps c_B(1);
        each stream waits for all of it); a speculative one may start a cooldown."""
        c = self.config
        if proposed and cost and self.judged(s):
            st = self._state.setdefault(s.id, _StreamState())
            st.gains.append((accepted + 1, cost))
            if len(st.gains) > c.window:
                st.gains.pop(0)
            if len(st.gains) == c.window:
                pays = sum(e for e, _ in st.gains) >= (1 + c.margin) * sum(x for _, x in st.gains)
                if not pays:
                    st.cooldown = min(c.cooldown << min(st.losses, 16), c.max_cooldown)
                    st.losses += 1
                    st.gains.clear()
                elif st.probing:
                    st.losses = 0
                st.probing = not pays
        if proposed == 0 or c.min_acceptance == 0:
            return
        st = self._state.setdefault(s.id, _StreamState())
        st.window.append((proposed, accepted))
        if len(st.window) > c.window:
            st.window.pop(0)
        if len(st.window) == c.window:
            p = sum(x for x, _ in st.window)
            a = sum(y for _, y in st.window)
            if a / p < c.min_acceptance:
                st.cooldown = c.cooldown
                st.window.clear()

    def release(self, s) -> None:
        self._state.pop(s.id, None)
