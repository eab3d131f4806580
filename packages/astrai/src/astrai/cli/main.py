"""The ``astrai`` console script."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai", description="AstrAI kernels: inspect and benchmark.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="installed plugins, what runs here and why, install commands")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    bench = sub.add_parser("bench", help="time every op through the resolver against the torch path")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bench.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of the speed-ups")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="only these benchmarks")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    from . import generate

    generate.add_arguments(sub.add_parser("generate", help="serve a model end to end: TTFT, tokens/s, memory"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from . import doctor

        return doctor.main(args)
    if args.command == "generate":
        from . import generate

        return generate.main(args)
    from . import bench

    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
