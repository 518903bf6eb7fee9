"""What `trt-spec export` makes, validated once: the model, the runtime its graphs are lowered
for and their precision, the engine folder, and the drafters by method (runtime/methods.py).
The command builds it from its options (--draft-model, --mtp, --eagle and --eagle3 go into
`drafters`, by method); export/pipeline.py export_model takes it.

    ExportConfig("smollm2-135m")       # int4 for ONNX Runtime, with the drafters shipped for it
    ExportConfig("models/tiny", "engines/tiny", "fp32", drafters={"eagle3": "ckpt/eagle3"},
                 draft_layers=2, shipped_drafters=False)

Torch-free: the command line reads it without loading the exporter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trt_spec.export.hub import hub_name
from trt_spec.runtime.methods import HEAD_METHODS, METHODS

# the precisions the graphs may have, by the runtime they are lowered for (and the default)
PRECISIONS = {"ort": ("fp32", "int8", "int4", "int4-head8", "int4-plain", "int8-rows"),
              "trt": ("fp32", "fp16")}
DEFAULT_PRECISION = {"ort": "int4", "trt": "fp16"}
LOWER_FOR = tuple(PRECISIONS)  # the runtimes the graphs are lowered for
# the methods whose drafter export writes: vanilla (a draft model) and the heads
DRAFTER_METHODS = tuple(n for n, m in METHODS.items() if m.needs_drafter)
# --draft-vocab: the vocabulary the vanilla draft's and the other heads draft over. A method
# with a reduced vocabulary of its own (Eagle3's d2t) lends it; FULL_VOCAB: the target's.
FULL_VOCAB = "none"
VOCAB_LENDERS = tuple(n for n, m in METHODS.items() if m.own_vocab)  # ("eagle3",)
DRAFT_VOCABS = (*VOCAB_LENDERS, FULL_VOCAB)


def default_out(model: str) -> Path:
    """engines/<model name>: a .gguf's stem, a folder's or a known model's name, a hub
    repository's name (org/name@revision -> engines/name)."""
    hub = hub_name(model)
    if hub is not None:
        return Path("engines") / hub.name
    return Path("engines") / (Path(model).stem if model.endswith(".gguf") else Path(model).name)


def check_draft_vocab(value) -> str | None:
    """--draft-vocab's value, lower case (None: the default, resolve_draft_vocab), or
    ValueError quoting it and saying what is allowed."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text.isdigit():
        raise ValueError(
            f"--draft-vocab {value!r}: a draft vocabulary of N tokens needs token "
            "frequencies, and export has no token-frequency source; use "
            + " or ".join(f"{m!r} (the {m} drafter's draft vocabulary)" for m in VOCAB_LENDERS)
            + f" or {FULL_VOCAB!r} (full heads)")
    if text not in DRAFT_VOCABS:
        raise ValueError(f"--draft-vocab {value!r}: expected one of {', '.join(DRAFT_VOCABS)}")
    return text


def resolve_draft_vocab(draft_vocab: str | None, drafters: dict[str, str]) -> str:
    """--draft-vocab's value and the drafters exported -> one of DRAFT_VOCABS. Default (None):
    the vocabulary of the first drafter that has its own (Eagle3's), else FULL_VOCAB."""
    value = check_draft_vocab(draft_vocab)
    if value is None:
        return next((m for m in VOCAB_LENDERS if m in drafters), FULL_VOCAB)
    if value != FULL_VOCAB and value not in drafters:
        raise ValueError(f"--draft-vocab {value!r} reuses the {value} drafter's draft "
                         f"vocabulary, and this export has no {value} drafter (give "
                         f"{METHODS[value].export_hint}, or --draft-vocab {FULL_VOCAB})")
    return value


@dataclass(frozen=True)
class ExportConfig:
    """One engine folder's export."""

    model: str  # a known model's name, a .gguf file, a Hugging Face folder or a hub name
    out: Path | None = None  # the engine folder (None: engines/<model name>)
    precision: str | None = None  # one of PRECISIONS[lower_for] (None: DEFAULT_PRECISION's)
    lower_for: str = "ort"  # the runtime the graphs are lowered for: ort | trt
    # the drafters, by method (DRAFTER_METHODS): a head's checkpoint folder; vanilla's, a
    # draft model (name, .gguf or Hugging Face folder; the target's vocabulary) or a trained
    # draft's folder (`trt-spec train --method draft`); any of them may be a hub name
    # (org/name[@revision], export/hub.py). None or "": no such drafter
    drafters: dict[str, str] = field(default_factory=dict)
    draft_layers: int = 0  # a vanilla self-draft: the target's first N layers (0: none)
    # what the vanilla draft and the heads without a vocabulary of their own draft over (one
    # of DRAFT_VOCABS; None: Eagle3's when an Eagle3 head is exported, else the full one)
    draft_vocab: str | None = None
    # a known model's drafters shipped in drafters/<model>/ too, each unless `drafters` (or
    # draft_layers, for the vanilla draft) names another
    shipped_drafters: bool = True

    def __post_init__(self):
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"model={self.model!r}: expected a model name, a .gguf file, a "
                             "Hugging Face folder or a hub name (org/name[@revision])")
        object.__setattr__(self, "model", str(self.model))
        object.__setattr__(self, "drafters", self._checked_drafters())
        object.__setattr__(self, "draft_vocab", check_draft_vocab(self.draft_vocab))
        if self.lower_for not in LOWER_FOR:
            raise ValueError(f"lower_for={self.lower_for!r}: expected one of "
                             f"{', '.join(LOWER_FOR)}")
        if self.precision is None:
            object.__setattr__(self, "precision", DEFAULT_PRECISION[self.lower_for])
        if self.precision not in PRECISIONS[self.lower_for]:
            raise ValueError(f"precision {self.precision!r} is not supported when lowering for "
                             f"{self.lower_for}; choose from "
                             f"{', '.join(PRECISIONS[self.lower_for])}")
        if not isinstance(self.draft_layers, int) or isinstance(self.draft_layers, bool) \
                or self.draft_layers < 0:
            raise ValueError(f"draft_layers={self.draft_layers!r}: must be an integer >= 0 "
                             "(0: no self-draft)")
        if self.draft_layers and self.draft_model:
            raise ValueError("give either --draft-layers (a self-draft) or --draft-model, "
                             "not both")
        if not isinstance(self.shipped_drafters, bool):
            raise ValueError(f"shipped_drafters={self.shipped_drafters!r}: expected True or "
                             "False")
        object.__setattr__(self, "out", default_out(self.model) if self.out is None
                           else Path(self.out))

    def _checked_drafters(self) -> dict[str, str]:
        """`drafters` with its paths as strings and the unnamed ones left out, in its order;
        ValueError for a method that has no drafter to export."""
        if not isinstance(self.drafters, dict):
            raise ValueError(f"drafters={self.drafters!r}: expected a dict of method -> "
                             "checkpoint")
        unknown = sorted(set(self.drafters) - set(DRAFTER_METHODS), key=str)
        if unknown:
            raise ValueError(f"drafters {unknown} are not known; known: "
                             f"{', '.join(DRAFTER_METHODS)}")
        return {m: str(path) for m, path in self.drafters.items() if path}

    @property
    def draft_model(self) -> str | None:
        """The vanilla draft's model or folder (None: none, or a self-draft)."""
        return self.drafters.get("vanilla")

    @property
    def heads(self) -> dict[str, str]:
        """The heads' checkpoint folders by method (HEAD_METHODS), in the drafters' order."""
        return {m: path for m, path in self.drafters.items() if m in HEAD_METHODS}
