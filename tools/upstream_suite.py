#!/usr/bin/env python3
"""Run upstream PyTorch's FSDP2 tests against the generated ``torch_fsdp_ext._fully_shard``.

Upstream's ``test/distributed/_composable/fsdp/test_fully_shard_*.py`` at the
installed torch's base are fetched into ``.upstream-tests/<torch release>/``
(never committed; see CONTRIBUTING.md). Each (file, mode, harness) runs under
pytest in a child process:

modes
  pristine   torch as installed
  grouped    ``torch.distributed.fsdp._fully_shard`` and every submodule are
             ``torch_fsdp_ext._fully_shard`` (``sys.modules`` and the attributes
             of ``torch.distributed.fsdp``), before any test module imports
  per-param  the same, with ``fully_shard`` defaulting to ``group_collectives=False``

harnesses
  threaded   as upstream runs on a machine without accelerators: threaded-PG
             tests run; FSDPTest/FSDPTestContinuous tests skip
  gloo       FSDPTest/FSDPTestContinuous and ``skip_if_lt_x_gpu`` lifted to run
             on CPU with gloo (``--gloo-devices`` stand-in devices)

The substitution is made by ``tools/_upstream_suite_site/sitecustomize.py``,
first on the child's ``PYTHONPATH``, so it also holds in every rank process
that the tests spawn. A self-check first shards a module in each mode, in the
child and in a spawned grandchild, and checks what ``fully_shard`` built.

The report is a table of pass/fail/skip counts per file, harness and mode, and
the tests that pass on pristine but fail in grouped or per-param (the
interesting output), apart from those that fail on pristine too.

Examples:
  python tools/upstream_suite.py                       # all files, threaded, 3 modes
  python tools/upstream_suite.py --harness gloo comm --json out.json
  python tools/upstream_suite.py --harness gloo training -k test_partial_group_reshard_toggle
"""

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE_DIR = Path(__file__).resolve().parent / "_upstream_suite_site"
MODES = ("pristine", "grouped", "per-param")
HARNESSES = ("threaded", "gloo")
UPSTREAM = "torch.distributed.fsdp._fully_shard"
EXT = "torch_fsdp_ext._fully_shard"
OUTCOME_RE = re.compile(r"^(\S+\.py::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
ERROR_LINE_RE = re.compile(r"^(E\s+)?([A-Za-z_][\w.]*(Error|Exception|Exit|Failure)|Failed)\b")
WRAPPER_ERROR_RE = re.compile(r"^RuntimeError: Process \d+ (exited|terminated)")

log = logging.getLogger("upstream_suite")


@dataclasses.dataclass
class Run:
    """One pytest child: one file in one mode under one harness."""

    file: str
    mode: str
    harness: str
    status: str = "not run"  # ok, failed (pytest exit 1), timeout, crashed (no results)
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""
    # test id -> {"outcome": passed|failed|error|skipped, "message": first error line}
    tests: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(t["outcome"] == outcome for t in self.tests.values())

    def failing(self) -> dict[str, dict[str, str]]:
        return {k: v for k, v in self.tests.items() if v["outcome"] in ("failed", "error")}


def torch_release() -> str:
    return importlib.metadata.version("torch").split("+")[0]


def generated_copy_stamp() -> str:
    """The stamp of the ``torch_fsdp_ext._fully_shard`` the children import.

    Others may regenerate it (another torch base) while a long run goes on;
    each run compares this before and after.
    """
    spec = importlib.util.find_spec("torch_fsdp_ext")
    if spec is None or spec.origin is None:
        raise SystemExit("error: torch_fsdp_ext is not importable")
    stamp = Path(spec.origin).parent / "_fully_shard" / "VENDORED.json"
    return stamp.read_text() if stamp.exists() else ""


def child_env(mode: str, harness: str, gloo_devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE_DIR), env.get("PYTHONPATH", "")) if p)
    env["TORCH_FSDP_EXT_SUITE_MODE"] = mode
    env["TORCH_FSDP_EXT_SUITE_HARNESS"] = harness
    env["TORCH_FSDP_EXT_SUITE_GLOO_DEVICES"] = str(gloo_devices)
    # Up to 8 rank processes share this machine's cores
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", "1")
    return env


# --- self-check (runs in a child with the suite's environment) ----------------


def _substitution_info() -> dict[str, object]:
    """What the FSDP2 import paths resolve to in this process."""
    import torch.distributed.fsdp as fsdp

    fully_shard = fsdp.fully_shard
    kwdefaults = getattr(fully_shard, "__wrapped__", fully_shard).__kwdefaults__ or {}
    package = sys.modules[UPSTREAM]
    return {
        "package": package.__name__,
        "param_group_module": sys.modules[f"{UPSTREAM}._fsdp_param_group"].__name__,
        # names torch.distributed.fsdp re-exports from the package, but not its objects
        "fsdp_attrs_not_from_package": sorted(
            name
            for name in package.__all__
            if hasattr(fsdp, name) and getattr(fsdp, name) is not getattr(package, name)
        ),
        "group_collectives_default": repr(kwdefaults.get("group_collectives", "<absent>")),
        "lifted": bool(getattr(sys.modules.get("sitecustomize"), "lifted", False)),
    }


def _self_check_child() -> int:
    import multiprocessing

    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp
    import torch.nn as nn
    from torch.testing._internal.common_fsdp import FSDPParamGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    info = _substitution_info()
    info["torch_fsdp_ext"] = sys.modules["torch_fsdp_ext"].__file__ if EXT in sys.modules else ""
    info["common_fsdp_param_group"] = FSDPParamGroup.__module__
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = fsdp.fully_shard(nn.Linear(4, 4))
        group = model._get_fsdp_state()._fsdp_param_group
        info["built_param_group"] = type(group).__module__
        info["group_collectives"] = repr(getattr(group, "group_collectives", "<absent>"))
    finally:
        dist.destroy_process_group()
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        info["spawned"] = pool.apply(_substitution_info)
    print(json.dumps(info))
    return 0


def expected_info(mode: str, harness: str) -> dict[str, object]:
    pkg = UPSTREAM if mode == "pristine" else EXT
    sub = {
        "package": pkg,
        "param_group_module": f"{pkg}._fsdp_param_group",
        "group_collectives_default": {
            "pristine": "'<absent>'",
            "grouped": "None",
            "per-param": "False",
        }[mode],
        "lifted": harness == "gloo",
        "fsdp_attrs_not_from_package": [],
    }
    return {
        **sub,
        "common_fsdp_param_group": f"{pkg}._fsdp_param_group",
        "built_param_group": f"{pkg}._fsdp_param_group",
        # grouped: None lets the backend decide, which on CPU is grouped
        "group_collectives": {"pristine": "'<absent>'", "grouped": "True", "per-param": "False"}[
            mode
        ],
        "spawned": sub,
    }


def self_check(mode: str, harness: str, gloo_devices: int, timeout: float) -> None:
    """Check in a child (and its spawned grandchild) that ``mode`` took effect."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--self-check-child"],
        env=child_env(mode, harness, gloo_devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"self-check failed for mode={mode} harness={harness} (exit {proc.returncode}):\n"
            f"{proc.stdout}{proc.stderr}"
        )
    info = json.loads(lines[-1])
    expected = expected_info(mode, harness)
    wrong = {key: (info.get(key), want) for key, want in expected.items() if info.get(key) != want}
    if wrong:
        detail = "\n".join(
            f"  {k}: got {got!r}, expected {want!r}" for k, (got, want) in wrong.items()
        )
        raise SystemExit(f"self-check failed for mode={mode} harness={harness}:\n{detail}")
    log.info(
        "self-check ok: mode=%s harness=%s group_collectives=%s %s",
        mode,
        harness,
        info["group_collectives"],
        info["torch_fsdp_ext"],
    )


# --- running and parsing ------------------------------------------------------


def first_error_line(text: str) -> str:
    """The line naming the exception, preferring a rank's over the wrapper's."""
    text = text.split("To execute this test, run the following")[0]
    candidates = []
    for raw in text.splitlines():
        line = raw.strip()
        if ERROR_LINE_RE.match(line):
            candidates.append(re.sub(r"^E\s+", "", line))
    inner = [c for c in candidates if not WRAPPER_ERROR_RE.match(c)]
    chosen = (inner or candidates or [text.strip().splitlines()[0] if text.strip() else ""])[-1]
    return chosen[:300]


def parse_junit(path: Path, file: str) -> dict[str, dict[str, str]]:
    tests: dict[str, dict[str, str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{file}::{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                message = first_error_line(f"{child.get('message', '')}\n{child.text or ''}")
                break
            if child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:300]
        tests[test_id] = {"outcome": outcome, "message": message}
    return tests


def parse_verbose_log(text: str) -> dict[str, dict[str, str]]:
    """Outcomes from ``pytest -v`` lines, for a child killed before its junit XML."""
    word = {
        "PASSED": "passed",
        "FAILED": "failed",
        "ERROR": "error",
        "SKIPPED": "skipped",
        "XFAIL": "skipped",
        "XPASS": "passed",
    }
    tests = {}
    for line in text.splitlines():
        match = OUTCOME_RE.match(line)
        if match:
            tests[Path(match[1].split("::")[0]).name + "::" + match[1].split("::", 1)[1]] = {
                "outcome": word[match[2]],
                "message": "",
            }
    return tests


def run_child(run: Run, test_dir: Path, selector: str, args: argparse.Namespace) -> Run:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{Path(run.file).stem}.{run.mode}.{run.harness}"
    log_path = log_dir / f"{stem}.log"
    xml_path = log_dir / f"{stem}.xml"
    xml_path.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as ini_dir:
        # An empty ini so the repo's pytest settings and conftest stay out
        ini = Path(ini_dir) / "pytest.ini"
        ini.write_text("[pytest]\n")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            str(test_dir / selector),
            "-v",
            "-rN",
            "-p",
            "no:cacheprovider",
            "-p",
            "_upstream_suite_plugin",
            "-c",
            str(ini),
            "--rootdir",
            str(test_dir),
            "--junitxml",
            str(xml_path),
        ]
        if args.k:
            cmd += ["-k", args.k]
        log.info(
            "run %s [%s, %s]%s",
            selector,
            run.mode,
            run.harness,
            f" -k {args.k!r}" if args.k else "",
        )
        log.debug("%s", " ".join(cmd))
        start = time.monotonic()
        stamp = generated_copy_stamp()
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=test_dir,
                env=child_env(run.mode, run.harness, args.gloo_devices),
                start_new_session=True,  # its own process group: the ranks die with it
            )
            try:
                run.returncode = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s [%s, %s] timed out after %ss", selector, run.mode, run.harness, args.timeout
                )
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(timeout=15)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
                run.status = "timeout"
        run.seconds = round(time.monotonic() - start, 1)
    run.log = str(log_path)
    if xml_path.exists():
        run.tests = parse_junit(xml_path, Path(run.file).name)
    else:
        run.tests = parse_verbose_log(log_path.read_text(errors="replace"))
    if run.status != "timeout":
        run.status = {0: "ok", 1: "failed", 5: "no tests"}.get(run.returncode, "crashed")
    if run.mode != "pristine" and generated_copy_stamp() != stamp:
        run.status = "invalid: generated copy changed during the run"
    return run


# --- report -------------------------------------------------------------------


def regressions(runs: list[Run]) -> list[dict[str, str]]:
    """Tests that pass on pristine but fail in another mode under the same harness."""
    pristine = {(r.file, r.harness): r for r in runs if r.mode == "pristine"}
    found = []
    for run in runs:
        base = pristine.get((run.file, run.harness))
        if run.mode == "pristine" or base is None:
            continue
        for test_id, result in run.failing().items():
            if base.tests.get(test_id, {}).get("outcome") == "passed":
                found.append(
                    {
                        "test": test_id,
                        "mode": run.mode,
                        "harness": run.harness,
                        "message": result["message"],
                    }
                )
    return found


def print_report(runs: list[Run], stream=sys.stdout) -> None:
    head = (
        f"{'file':<40} {'harness':<9} {'mode':<10} {'pass':>5} {'fail':>5} {'skip':>5} "
        f"{'secs':>7}  status"
    )
    print(head, file=stream)
    print("-" * len(head), file=stream)
    for r in runs:
        fails = r.count("failed") + r.count("error")
        print(
            f"{Path(r.file).name:<40} {r.harness:<9} {r.mode:<10} {r.count('passed'):>5} "
            f"{fails:>5} {r.count('skipped'):>5} {r.seconds:>7.1f}  {r.status}",
            file=stream,
        )
    found = regressions(runs)
    print(f"\nPass on pristine, fail in grouped/per-param: {len(found)}", file=stream)
    for item in found:
        print(
            f"  [{item['harness']}, {item['mode']}] {item['test']}\n      {item['message']}",
            file=stream,
        )
    regressed = {(f["test"], f["mode"], f["harness"]) for f in found}
    other = [
        (r, t, res)
        for r in runs
        for t, res in r.failing().items()
        if (t, r.mode, r.harness) not in regressed
    ]
    print(
        f"\nOther failing tests (fail on pristine too, or no pristine run): {len(other)}",
        file=stream,
    )
    for r, test_id, res in other:
        print(f"  [{r.harness}, {r.mode}] {test_id}\n      {res['message'][:160]}", file=stream)


def write_json(path: str, runs: list[Run], test_dir: Path, args: argparse.Namespace) -> None:
    report = {
        "torch": importlib.metadata.version("torch"),
        "dir": str(test_dir),
        "k": args.k,
        "runs": [dataclasses.asdict(r) for r in runs],
        "pass_pristine_fail_ext": regressions(runs),
    }
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


# --- CLI ----------------------------------------------------------------------


def select_files(test_dir: Path, names: list[str]) -> list[str]:
    """``names`` as files (or pytest node ids) under ``test_dir``; all files if empty."""
    available = sorted(p.name for p in test_dir.glob("test_fully_shard_*.py"))
    if not names:
        return available
    chosen = []
    for name in names:
        file, sep, node = name.partition("::")
        file = Path(file).name
        candidates = [file, f"{file}.py", f"test_fully_shard_{file}", f"test_fully_shard_{file}.py"]
        match = next((c for c in candidates if c in available), None)
        if match is None:
            raise SystemExit(f"no upstream test file {name!r} in {test_dir}")
        chosen.append(match + sep + node)
    return chosen


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "tests",
        nargs="*",
        metavar="FILE",
        help="files to run (test_fully_shard_comm.py, or just 'comm'; a pytest "
        "node id FILE::Class::test works too); default: all",
    )
    parser.add_argument(
        "--dir",
        help="the fetched upstream tests (default: .upstream-tests/<installed torch release>)",
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all three"
    )
    parser.add_argument(
        "--harness", nargs="+", choices=HARNESSES, default=["threaded"], help="default: threaded"
    )
    parser.add_argument("-k", help="pytest -k expression selecting tests in each file")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds for each child before it and its ranks are killed (default: %(default)s)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="children at once (default: 1; gloo runs up to 8 ranks each)",
    )
    parser.add_argument(
        "--gloo-devices",
        type=int,
        default=8,
        help="devices the gloo harness stands in for: skip_if_lt_x_gpu(x) runs "
        "for x up to this, and device_count()-sized worlds get it "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write a JSON report (rewritten after each child, so a long run can be watched)",
    )
    parser.add_argument(
        "--log-dir", help="where each child's log and junit XML go (default: .upstream-tests/logs)"
    )
    parser.add_argument(
        "--no-self-check",
        action="store_true",
        help="skip the start-up check that each mode took effect",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--self-check-child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    if args.self_check_child:
        return _self_check_child()
    test_dir = Path(args.dir) if args.dir else REPO / ".upstream-tests" / torch_release()
    if not test_dir.is_dir():
        print(
            f"error: no upstream tests at {test_dir}.\nFetch upstream's "
            "test/distributed/_composable/fsdp/test_fully_shard_*.py at the installed torch's "
            "base commit (patches/<release>/base.toml) into it, as CONTRIBUTING.md describes "
            "(they are never committed).",
            file=sys.stderr,
        )
        return 2
    args.log_dir = args.log_dir or str(REPO / ".upstream-tests" / "logs")
    files = select_files(test_dir, args.tests)
    modes = [m for m in MODES if m in args.modes]
    if not args.no_self_check:
        for harness in args.harness:
            for mode in modes:
                self_check(mode, harness, args.gloo_devices, timeout=300)

    runs = [Run(file=f, mode=m, harness=h) for h in args.harness for f in files for m in modes]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(run_child, r, test_dir, r.file, args): r for r in runs}
        for future in concurrent.futures.as_completed(futures):
            r = future.result()
            log.info(
                "%s [%s, %s]: %d passed, %d failed, %d skipped in %.0fs (%s)",
                r.file,
                r.mode,
                r.harness,
                r.count("passed"),
                r.count("failed") + r.count("error"),
                r.count("skipped"),
                r.seconds,
                r.status,
            )
            if args.json:
                write_json(args.json, [x for x in runs if x.status != "not run"], test_dir, args)
    print_report(runs)
    if args.json:
        write_json(args.json, runs, test_dir, args)
    bad = regressions(runs) or any(r.status not in ("ok", "failed", "no tests") for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
