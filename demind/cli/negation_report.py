"""``demind-negation-report`` / ``python -m demind.cli.negation_report``: the rule decomposer's
accuracy on the labelled phrasings and what it flags in CIRR caption files.

    python -m demind.cli.negation_report \\
        --cirr /work/shared/fixtures/cirr/captions/cap.rc2.val.json /work/shared/fixtures/cirr/captions/cap.rc2.test1.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from demind.cli.common import run_command
from demind.io import write_json_atomic
from demind.negation.decompose import RuleDecomposer
from demind.negation.report import PHRASINGS, cirr_flags, format_report, load_phrasings, rule_accuracy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demind-negation-report", description=__doc__.split("\n\n")[0])
    p.add_argument("--phrasings", default=str(PHRASINGS), help="labelled JSONL (default: the shipped set)")
    p.add_argument("--cirr", nargs="*", default=[], help="CIRR caption files cap.rc2.<split>.json")
    p.add_argument("--examples", type=int, default=3, help="example captions per cue")
    p.add_argument("--json", help="also write the numbers here")
    return p


def report_command(args: argparse.Namespace) -> int:
    """Score the rules on the labelled set, count CIRR flags, print (and write) both."""
    rules = RuleDecomposer()
    acc = rule_accuracy(rules, load_phrasings(args.phrasings))
    flags = cirr_flags(args.cirr, rules, args.examples) if args.cirr else None
    print(format_report(acc, flags))
    if args.json:
        write_json_atomic(args.json, {"accuracy": {**asdict(acc), "fraction": acc.fraction}, "cirr": flags}, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), report_command, argv)


if __name__ == "__main__":
    sys.exit(main())
