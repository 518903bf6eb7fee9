"""Export a model with randomly initialised MTP (3 modules), Eagle and Eagle3 heads: the
drafter graphs at their real size, for plumbing, size and memory measurements until trained
heads ship (their drafts are almost never accepted, so they make generation slower).

    python scripts/random_heads.py --model smollm2-135m --precision int4 --out engines/x
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.random_drafters import random_eagle3, random_mtp  # noqa: E402
from trt_spec.export.checkpoint import load_target, resolve_model  # noqa: E402
from trt_spec.export.drafter_checkpoint import save_drafter  # noqa: E402
from trt_spec.export.config import ExportConfig  # noqa: E402
from trt_spec.export.pipeline import export_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", default="int4", choices=["fp32", "int8", "int4"])
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target, _ = load_target(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        heads = Path(tmp)
        save_drafter(random_mtp(target, 3, seed=1), heads / "mtp")
        save_drafter(random_mtp(target, 1, seed=2, kind="eagle"), heads / "eagle")
        save_drafter(random_eagle3(target, seed=3, draft_vocab=args.draft_vocab), heads / "eagle3")
        export_model(ExportConfig(args.model, args.out, args.precision,
                                  drafters={k: heads / k for k in ("mtp", "eagle", "eagle3")},
                                  shipped_drafters=False), force=True)


if __name__ == "__main__":
    main()
