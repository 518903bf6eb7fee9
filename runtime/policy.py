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
    - an adaptive stream (`auto` k) whose tokens per unit of cost over its last `window`
      steps fell below 1 (plain decoding would have been faster)   -> 0 for `cooldown`
      steps, then it tries again
    - else its k, capped by the tokens still allowed and the room left in the cache.
The policy keeps its own per-stream state (the windows and the cooldown), by stream id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trt_spec.runtime.settings import SpeculationConfig


@dataclass
class _StreamState:
    window: list[tuple[int, int]] = field(default_factory=list)  # (proposed, accepted)
    gains: list[tuple[int, float]] = field(default_factory=list)  # (emitted, cost in c(1))
    cooldown: int = 0  # plain steps left before drafting again


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

    def plan(self, streams: list) -> list[int]:
        """Tokens to draft per stream this step; counts down the cooldowns it passes."""
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
                ks.append(min(s.num_draft_tokens, self.room(s)))
        return ks

    def observe(self, s, proposed: int, accepted: int, cost: float | None = None) -> None:
        """Records a speculative step (cost: its share of time in plain decoding steps, c(1));
        may start a cooldown."""
        c = self.config
        if proposed and s.adaptive and cost:
            st = self._state.setdefault(s.id, _StreamState())
            st.gains.append((accepted + 1, cost))
            if len(st.gains) > c.window:
                st.gains.pop(0)
            if len(st.gains) == c.window and (sum(e for e, _ in st.gains)
                                              < sum(x for _, x in st.gains)):
                st.cooldown = c.cooldown
                st.gains.clear()
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
