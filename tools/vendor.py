#!/usr/bin/env python3
"""Regenerate torch_fsdp_ext/_fully_shard/ from the installed torch plus patches/.

The output is deterministic and never edited by hand; see CONTRIBUTING.md.
"""

from __future__ import annotations

import argparse

from _patchlib import log, setup_logging, vendor


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    setup_logging()
    try:
        wrote = vendor.vendor()
    except vendor.VendorError as e:
        raise SystemExit(f"error: {e}") from None
    log.info("%s %s", "regenerated" if wrote else "up to date:", vendor.VENDORED_DIR)


if __name__ == "__main__":
    main()
