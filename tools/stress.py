#!/usr/bin/env python3
"""Run chosen tests N times under glibc's heap checks and report pass/fail counts.

Each run is a fresh ``pytest`` process with ``MALLOC_CHECK_=3`` (abort on heap
corruption) and a different non-zero ``MALLOC_PERTURB_`` (freed and new memory is
filled with a byte pattern, so a read or write after free changes results or
crashes instead of going unnoticed). ``--load N`` keeps N busy-looping processes
running beside the tests, which shifts the timing of gloo's worker threads the
way a loaded CI machine does. The output of every failed run is kept under
``--log-dir``.

On glibc 2.34 and newer, ``MALLOC_CHECK_`` only takes effect when
``libc_malloc_debug.so`` is preloaded (``--malloc-debug``). That debug
allocator changes the heap layout: it hid the gloo crash this tool was built
for (0 of 10 runs, against about 1 in 5 without it), so it is off by default
and glibc's own tcache and fastbin checks do the detecting.

Example::

    python tools/stress.py -n 50 --load 1 -- test/package/test_moe.py -k W4
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("stress")


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def _busy_cores(n: int) -> Iterator[None]:
    """Keeps ``n`` cores busy while the block runs."""
    procs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


_MALLOC_DEBUG_LIBS = (
    "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
    "/lib/aarch64-linux-gnu/libc_malloc_debug.so.0",
    "/usr/lib64/libc_malloc_debug.so.0",
)


def _malloc_debug_lib() -> str:
    for path in _MALLOC_DEBUG_LIBS:
        if os.path.exists(path):
            return path
    raise SystemExit(
        "error: --malloc-debug needs glibc's libc_malloc_debug.so.0 (glibc 2.34+); "
        f"looked in {', '.join(_MALLOC_DEBUG_LIBS)}"
    )


def _run_once(
    pytest_args: list[str], perturb: int, timeout: float, preload: str | None
) -> tuple[str, str]:
    """Runs pytest once; returns (outcome, combined output)."""
    env = dict(os.environ, MALLOC_CHECK_="3", MALLOC_PERTURB_=str(perturb))
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *pytest_args]
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return "timeout", out
    return ("pass" if proc.returncode == 0 else f"fail (rc {proc.returncode})"), (
        proc.stdout + proc.stderr
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--runs", type=int, default=50, help="runs (default 50)")
    parser.add_argument(
        "--load", type=int, default=1, help="busy-looping processes beside the tests (default 1)"
    )
    parser.add_argument(
        "--timeout", type=float, default=600, help="seconds before a run counts as hung"
    )
    parser.add_argument(
        "--log-dir", type=Path, default=Path("stress-logs"), help="where failed runs' output goes"
    )
    parser.add_argument(
        "--stop-on-failure", action="store_true", help="stop at the first failed run"
    )
    parser.add_argument(
        "--malloc-debug",
        action="store_true",
        help="preload glibc's libc_malloc_debug.so so that MALLOC_CHECK_=3 acts (see above)",
    )
    parser.add_argument("pytest_args", nargs="+", help="what to pass to pytest (after --)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    preload = _malloc_debug_lib() if args.malloc_debug else None

    counts: dict[str, int] = {}
    start = time.monotonic()
    with _busy_cores(args.load):
        for i in range(1, args.runs + 1):
            # 1..255: MALLOC_PERTURB_=0 would turn perturbation off
            perturb = 1 + (i * 37) % 255
            t0 = time.monotonic()
            outcome, output = _run_once(args.pytest_args, perturb, args.timeout, preload)
            counts[outcome] = counts.get(outcome, 0) + 1
            where = ""
            if outcome != "pass":
                args.log_dir.mkdir(parents=True, exist_ok=True)
                path = args.log_dir / f"run-{i:03d}.log"
                path.write_text(f"MALLOC_PERTURB_={perturb}\n{output}")
                where = f" -> {path}"
            log.info(
                "run %d/%d: %s in %.0f s (MALLOC_PERTURB_=%d)%s",
                i,
                args.runs,
                outcome,
                time.monotonic() - t0,
                perturb,
                where,
            )
            if outcome != "pass" and args.stop_on_failure:
                break
    runs = sum(counts.values())
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    log.info(
        "%d runs of pytest %s with --load %d: %s (%.0f s)",
        runs,
        " ".join(args.pytest_args),
        args.load,
        summary,
        time.monotonic() - start,
    )
    sys.exit(0 if counts.get("pass", 0) == runs else 1)


if __name__ == "__main__":
    main()
