"""The ``astrai`` console script.

A mistake the user can fix (a bad value, an unknown name, a missing extra) is answered
before any work with one line per problem on stderr, ``astrai <command>: ...``, and exit
status 2, as argparse answers a bad command line; never with a traceback.
"""

from __future__ import annotations

import argparse
import sys

from .checks import USAGE_EXIT, UsageError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrai", description="AstrAI kernels: inspect, benchmark and serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="installed plugins, what runs here and why, install commands")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    bench = sub.add_parser("bench", help="time every op through the resolver against the torch path")
    bench.add_argument("--json", metavar="FILE", help="write the results as JSON")
    bench.add_argument("--plot", metavar="FILE", help="write a PNG bar chart of the speed-ups (astrai[plot])")
    bench.add_argument("--ops", nargs="+", metavar="OP",
                       help="only these benchmarks: a benchmark's name or a word of it (decode, rotary, fp8), "
                            "or an op name doctor lists (attn_paged_decode, rotary_emb, fp8_gemm, ...)")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    from . import generate

    generate.add_arguments(sub.add_parser("generate", help="serve a model end to end: TTFT, tokens/s, memory"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            from . import doctor

            return doctor.main(args)
        if args.command == "generate":
            from . import generate

            return generate.main(args)
        from . import bench

        return bench.main(args)
    except UsageError as exc:
        first, *rest = str(exc).splitlines() or [""]
        print(f"astrai {args.command}: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
