"""When to speculate: RTP-LLM's force_disable_sp_run, generalised into configurable rules.

Per step and stream, `draft_tokens` returns how many tokens to draft (0 = a plain decode
step for that stream, in the same target forward as the others):
    - the request asked for no speculation                       -> 0
    - more streams are decoding than `max_batch`                  -> 0 for all (the batch
      already keeps the CPU busy; verifying k+1 tokens per stream costs more than it saves)
    - the stream's acceptance rate over its last `window` speculative steps fell below
      `min_acceptance`                                             -> 0 for `cooldown` steps,
      then it tries again (the condition clears when acceptance recovers)
    - else k, capped by the tokens still allowed and the room left in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationConfig:
    num_draft_tokens: int = 4
    max_batch: int | None = None  # None: no limit
    min_acceptance: float = 0.0  # 0: never turned off for low acceptance
    window: int = 8  # speculative steps in the rolling acceptance window
    cooldown: int = 16  # plain steps before speculating again

    def __post_init__(self):
        if not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}: must be in 1..64")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}: must be >= 1 (or None for no limit)")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance={self.min_acceptance}: must be in [0, 1]")
        if self.window < 1 or self.cooldown < 0:
            raise ValueError(f"window={self.window}, cooldown={self.cooldown}: need window >= 1, "
                             "cooldown >= 0")


class SpeculationPolicy:
    def __init__(self, config: SpeculationConfig, max_len: int):
        self.config = config
        self.max_len = max_len

    def draft_tokens(self, s, batch: int) -> int:
        c = self.config
        if not s.speculate:
            return 0
        if c.max_batch is not None and batch > c.max_batch:
            return 0
        if s.spec_cooldown > 0:
            s.spec_cooldown -= 1
            return 0
        remaining = s.params.max_tokens - len(s.output_ids)  # tokens still allowed
        cached = len(s.prompt_ids) + len(s.output_ids) - 1  # rows the target cache holds
        room = self.max_len - cached - 1  # rows left after the last token's
        return max(0, min(c.num_draft_tokens, remaining - 1, room))

    def observe(self, s, proposed: int, accepted: int) -> None:
        """Records a speculative step; may start a cooldown."""
        c = self.config
        if proposed == 0 or c.min_acceptance == 0:
            return
        s.spec_window.append((proposed, accepted))
        if len(s.spec_window) > c.window:
            s.spec_window.pop(0)
        if len(s.spec_window) == c.window:
            p = sum(x for x, _ in s.spec_window)
            a = sum(y for _, y in s.spec_window)
            if a / p < c.min_acceptance:
                s.spec_cooldown = c.cooldown
                s.spec_window.clear()
