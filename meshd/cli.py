"""The `meshd` command line: one entry point, one subcommand per job.

Each subcommand lives in the module that does the job and exposes
`register(subparsers)`, which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that contribute subcommands, in the order `meshd --help` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "meshd.sidecar",
    "meshd.config_cmd",
    "meshd.iptables",
    "xds.cli",
    "meshd.agent",
    "meshd.extproc",
    "meshd.inject",
    "meshd.webhook",
    "meshd.cost_cmd",
    "meshd.demo",
    "loadtest.bench.cli",
    "loadtest.engine.cli",
    "meshd.version_cmd",
)

DESCRIPTION = """\
meshd routes LLM inference requests (OpenAI-compatible HTTP) to the engine
where they are served cheapest and fastest, and keeps streams alive when
engines fail. Run `meshd COMMAND --help` for the options of each command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshd",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A subcommand whose module is not part of this build (an optional
            # part still being written) is left out rather than breaking the CLI.
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    result: int = func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
