"""`llmpipe quantize`: GPTQ / AWQ (or round-to-nearest) 4-bit weights into a Hugging Face directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from llmpipe.quant.quantize import CALIBRATION_TEXT, METHODS


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="GPTQ / AWQ 4-bit quantization, written as a GPTQ / AWQ checkpoint")
    q.add_argument("--model", default="smollm2-135m-instruct", help="alias, Hugging Face directory or .gguf file")
    q.add_argument("--method", required=True, choices=METHODS, help="rtn: round-to-nearest, no calibration")
    q.add_argument("--bits", type=int, default=4, choices=[4])
    q.add_argument("--group-size", type=int, default=128)
    q.add_argument("--act-order", action="store_true", help="GPTQ: quantize columns by decreasing Hessian diagonal")
    q.add_argument("--calib", type=Path, default=CALIBRATION_TEXT, help="calibration text (default: Othello, shipped)")
    q.add_argument("--num-samples", type=int, default=32, help="calibration windows")
    q.add_argument("--seq-len", type=int, default=512, help="tokens per calibration window")
    q.add_argument("--damp-percent", type=float, default=0.01, help="GPTQ Hessian dampening, fraction of its mean diagonal")
    q.add_argument("--num-threads", type=int, default=None)
    q.add_argument("--out", type=Path, required=True, help="output directory")
    q.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> None:
    from llmpipe.quant.quantize import quantize_model

    out = quantize_model(
        args.model, args.method, args.out, group_size=args.group_size, act_order=args.act_order, calib=args.calib,
        num_samples=args.num_samples, seq_len=args.seq_len, damp_percent=args.damp_percent, num_threads=args.num_threads,
    )
    print(f"wrote {args.method} {args.bits}-bit (group size {args.group_size}) checkpoint to {out}")
