"""A model quantized to 4 bits in the GPTQ checkpoint layout, by GPTQ's error feedback
(calibrated on chat-rendered ShareGPT *training* conversations; the held-out split, which
benchmarks and `trt-spec fidelity` prompt with, is never read) or by round-to-nearest.
`trt-spec export --model OUT` then reads it exactly (export/int4_checkpoint.py).

    python scripts/quantize_gptq.py --model smollm2-135m --out models/smollm2-135m-gptq
    python scripts/quantize_gptq.py --model smollm2-135m --out models/smollm2-135m-rtn --rtn

SmolLM2-135M on the 2-vCPU VM, shared (load ~11): 14 min for GPTQ (16 conversations x 256
tokens, 3,962), 40 s for RTN. Not resumable: a stopped run starts again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m",
                        help="a known model name, a .gguf or a Hugging Face folder")
    parser.add_argument("--out", type=Path, required=True, help="the GPTQ folder to write")
    parser.add_argument("--group", type=int, default=32, help="input features per group")
    parser.add_argument("--rtn", action="store_true", help="round-to-nearest, no calibration")
    parser.add_argument("--sym", action="store_true", help="symmetric grid (zero point 8)")
    parser.add_argument("--act-order", action="store_true",
                        help="GPTQ's desc_act: features by decreasing Hessian diagonal")
    parser.add_argument("--conversations", type=int, default=16,
                        help="ShareGPT training conversations to calibrate on")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per conversation")
    args = parser.parse_args(argv)
    if args.group < 16 or args.group & (args.group - 1):
        parser.error(f"--group {args.group}: expected a power of two >= 16 (MatMulNBits' "
                     "block sizes)")

    import torch

    from trt_spec.export.checkpoint import load_target, resolve_model
    from trt_spec.export.gptq_quantize import gptq_config, quantize_target, write_folder
    from trt_spec.export.smooth import calibration_sequences

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    torch.manual_seed(0)
    hf_dir = resolve_model(args.model)
    target, config = load_target(hf_dir)
    sequences = None
    if not args.rtn:
        sequences = calibration_sequences(hf_dir, args.conversations, args.max_tokens, log,
                                          purpose="GPTQ calibration")
    t0 = time.time()
    log(f"quantizing {config.num_layers} layers of {hf_dir} "
        f"({'RTN' if args.rtn else 'GPTQ'}, group {args.group}"
        f"{', symmetric' if args.sym else ''}{', act order' if args.act_order else ''}) ...")
    codes = quantize_target(target, sequences, args.group, args.sym, args.act_order, log)
    qc = gptq_config(args.group, args.sym, args.act_order)
    write_folder(hf_dir, args.out, codes, config, qc)
    log(f"wrote {args.out} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
