"""`meshd version`: the version and which hot-path implementation is active."""

from __future__ import annotations

import argparse
import platform

from meshd import __version__


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "version",
        help="print the version and whether the Cython hot path is active",
        description="Print meshd's version, the Python it runs on, and whether the "
        "compiled (Cython) hot path or its pure-Python twin is in use.",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from filters.hotpath import IMPLEMENTATION

    print(f"meshd {__version__}")
    print(f"python {platform.python_version()} ({platform.python_implementation()})")
    print(f"hot path: {IMPLEMENTATION}")
    from filters.picker import IMPLEMENTATION as PICKER

    print(f"picker loop: {PICKER}")
    from xds.engine_report import IMPLEMENTATION as XDS_DECODE

    print(f"xds EndpointState decode: {XDS_DECODE}")
    from xds.delta_response import IMPLEMENTATION as XDS_READ

    print(f"xds response read: {XDS_READ}")
    from filters.endpoint_state import IMPLEMENTATION as REPORT

    print(f"endpoint state report: {REPORT}")
    from filters.cost_ledger import IMPLEMENTATION as LEDGER

    print(f"cost ledger: {LEDGER}")
    return 0
