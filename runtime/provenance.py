"""Where each output token came from: a draft the target accepted (and which drafter), the
grammar, or the target itself.

A decode step emits its accepted draft tokens, then one token the target chose (the
rejected position's replacement, or the bonus token after a fully accepted draft). So a
step's tokens are, in order:

    position 1 .. accepted     the draft's source: lookup, corpus, head, draft or grammar
    position accepted + 1      target

and the prefill's first token (step 0) is the target's. A stop condition may cut a step's
tokens short: the sources are cut with them (runtime/stream.py append).

    source    what put the token there
    target    the target's own choice (plain decoding, a rejection's replacement, a bonus)
    grammar   forced by the structure the output is held to: drafted for free, verified
    lookup    an n-gram lookup in the request's or earlier requests' tokens (ngram, suffix)
    corpus    a corpus chain (suffix's phrase table, runtime/corpus.py)
    head      a head over the target's features (mtp, eagle, eagle3)
    draft     a draft model (vanilla)
"""

from __future__ import annotations

from dataclasses import dataclass

from trt_spec.runtime.methods import traits

TARGET = "target"
GRAMMAR = "grammar"  # the source of grammar-forced drafts (no drafter ran)
SOURCES = (TARGET, GRAMMAR, "lookup", "corpus", "head", "draft")


@dataclass(frozen=True, slots=True)
class TokenSource:
    """One output token's origin."""

    source: str  # one of SOURCES
    drafter: str | None  # the proposer that drafted its step (suffix, mtp, grammar); None: none
    step: int  # the stream's step that emitted it: 0 the prefill, then one per decode step
    position: int  # 1-based among the tokens its step emitted
    # how many tokens its step's drafter drafted (the k the policy chose, after its cuts; a
    # run the grammar forced after them is not counted: its tokens are `grammar`)
    drafted: int

    def as_json(self, token_id: int, text: str) -> dict:
        """The API's entry (the server's `token_sources`)."""
        return {"id": token_id, "text": text, "source": self.source, "drafter": self.drafter,
                "step": self.step, "position": self.position, "drafted": self.drafted}


def drafter_source(drafter: str, corpus: bool = False) -> str:
    """The source a drafter's accepted tokens report."""
    if drafter == GRAMMAR:
        return GRAMMAR
    if corpus:
        return "corpus"
    method = traits(drafter)
    if method.lookup:
        return "lookup"
    return "head" if method.reads else "draft"  # (a head reads the target's per-token outputs)


def step_sources(step: int, drafter: str | None, drafted: int, accepted: int, emitted: int,
                 corpus: bool = False) -> list[TokenSource]:
    """The sources of one step's `emitted` tokens: `accepted` drafts, then the target's
    (`drafted`: the drafter's own tokens; accepted may run past them into a forced run,
    which the caller marks)."""
    drafter = drafter if drafted else None
    kind = drafter_source(drafter, corpus) if drafter else TARGET
    return [TokenSource(kind if j < accepted else TARGET, drafter, step, j + 1, drafted)
            for j in range(emitted)]


def counts(sources: list[TokenSource]) -> dict[str, int]:
    """Tokens per source (every source named, 0 where none)."""
    out = dict.fromkeys(SOURCES, 0)
    for s in sources:
        out[s.source] += 1
    return out
