#!/usr/bin/env python3
"""The patch tooling: edit, generate, check, port and upstream the series in patches/.

Each command works on the installed torch's base unless given --base VERSION
(and --torch PATH where it reads pristine files); `COMMAND --help` says more.
See CONTRIBUTING.md for the loop.
"""

from __future__ import annotations

import argparse
import sys

from patchlib import apply, check, port, stack, vendor, workspace
from patchlib.common import setup_logging
from patchlib.common import vendor as generation

COMMANDS = {
    "workspace": workspace,
    "vendor": vendor,
    "check": check,
    "stack": stack,
    "port": port,
    "apply": apply,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == [workspace.FORMAT_TREE]:
        workspace.format_tree()
        return 0
    parser = argparse.ArgumentParser(
        prog="tools/patches.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="tool", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        module.add_arguments(
            commands.add_parser(
                name,
                help=module.__doc__.splitlines()[0],
                description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    args = parser.parse_args(argv)
    setup_logging()
    try:
        return COMMANDS[args.tool].run(args) or 0
    except generation.VendorError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
