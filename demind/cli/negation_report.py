"""``demind-negation-report`` / ``python -m demind.cli.negation_report``: the rule decomposer's
accuracy on the labelled phrasings and what it flags in CIRR caption files.

    python -m demind.cli.negation_report \\
        --cirr data/CIRR/captions/cap.rc2.val.json data/CIRR/captions/cap.rc2.test1.json
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass

from demind.cli.common import Flag, config_parser, run_config_command
from demind.settings import setting
from demind.io import check_output_file, write_json_atomic
from demind.negation.decompose import RuleDecomposer
from demind.negation.report import PHRASINGS, cirr_flags, format_report, load_phrasings, rule_accuracy


@dataclass
class NegationReportConfig:
    phrasings: str = setting(str(PHRASINGS), input="file", help="labelled JSONL (default: the shipped set)")
    cirr: list[str] = setting(default_factory=list, input="file", help="CIRR caption files cap.rc2.<split>.json")
    examples: int = setting(3, ge=0, help="example captions per cue")
    json: str | None = setting(None, output="file", help="also write the numbers here")


FLAGS = {"--phrasings": Flag("phrasings"), "--cirr": Flag("cirr", many=True), "--examples": Flag("examples"),
         "--json": Flag("json")}


def build_parser():
    return config_parser(NegationReportConfig, "demind-negation-report", __doc__.split("\n\n")[0], FLAGS)


def report_command(args: NegationReportConfig) -> int:
    """Score the rules on the labelled set, count CIRR flags, print (and write) both."""
    if args.json:
        check_output_file(args.json)  # before the report is computed, not after
    rules = RuleDecomposer()
    acc = rule_accuracy(rules, load_phrasings(args.phrasings))
    flags = cirr_flags(args.cirr, rules, args.examples) if args.cirr else None
    print(format_report(acc, flags))
    if args.json:
        write_json_atomic(args.json, {"accuracy": {**asdict(acc), "fraction": acc.fraction}, "cirr": flags}, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_config_command(NegationReportConfig, build_parser(), report_command, argv)


if __name__ == "__main__":
    sys.exit(main())
