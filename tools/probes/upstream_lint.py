"""Count PyTorch's own linters' findings in the series' files, pristine vs patched.

PyTorch's lint CI runs ruff, flake8 (with flake8-bugbear and
flake8-comprehensions), TorchFix, pyrefly and mypy. This runs each (ruff from
requirements.txt, the others from requirements-lint.txt) on every file the
series touches, once in a copy of the installed torch with the pristine files
and once with the patched ones, and prints the findings per tool (by file,
code and message, not line) and the new ones: those whose file has more
findings of their code patched than pristine (a pristine finding whose message
quotes an edited line is listed as changed, not new). It exits 1 if there is a
new one. ruff, flake8 and TorchFix see the ``torch/`` and ``test/``
files; pyrefly and mypy the ``torch/`` ones only, as PyTorch's ``mypy.ini``
``files`` and ``pyrefly.toml`` ``project-includes`` leave
``test/distributed/`` out.

PyTorch's configs are PyTorch's and are never committed: put its ``.flake8``,
``pyrefly.toml`` and ``mypy.ini`` (from a pytorch checkout at the base's commit)
into the ignored ``.upstream-lint/`` first (CONTRIBUTING.md, "Lint as upstream
does"). The linters run from ``--lint-python`` (a venv with requirements-lint.txt);
the series comes from ``.workspace/<version>`` (tools/patches.py workspace init).

    .venv/bin/python tools/probes/upstream_lint.py --lint-python .venv-lint/bin/python
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
from patchlib.common import PYTORCH_RUFF, torch_tree  # noqa: E402

TOOLS = ("ruff", "flake8", "torchfix", "pyrefly", "mypy")
# PyTorch's type checkers cover torch/ and a few named test files only
TYPE_CHECKERS = ("pyrefly", "mypy")


def _git(ws: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=ws, check=True, capture_output=True, text=True).stdout


def _findings(tool: str, python: str, root: Path, rels: list[str], config: Path) -> list[str]:
    bin_dir = Path(python).parent
    if tool in TYPE_CHECKERS:
        rels = [rel for rel in rels if rel.startswith("torch/")]
    if tool == "ruff":
        cmd = [sys.executable, "-m", "ruff", "check", "--config", str(PYTORCH_RUFF)]
        cmd += ["--no-cache", "--output-format", "concise", *rels]
        pattern = r"^(?P<file>[^:]+):\d+:\d+: (?P<msg>.*)$"
    elif tool == "flake8":
        cmd = [python, "-m", "flake8", "--config", str(config / ".flake8"), *rels]
        pattern = r"^(?P<file>[^:]+):\d+:\d+: (?P<msg>.*)$"
    elif tool == "torchfix":
        cmd = [str(bin_dir / "torchfix"), *rels]
        pattern = r"^(?P<file>[^:]+):\d+:\d+: (?P<msg>.*)$"
    elif tool == "pyrefly":
        shutil.copyfile(config / "pyrefly.toml", root / "pyrefly.toml")
        cmd = [str(bin_dir / "pyrefly"), "check", "--output-format", "min-text", *rels]
        pattern = r"^(?:ERROR|WARN) (?P<file>[^:]+):\d+:\d+(?:-\d+(?::\d+)?)?: (?P<msg>.*)$"
    else:
        shutil.copyfile(config / "mypy.ini", root / "mypy.ini")
        cmd = [python, "-m", "mypy", "--config-file", "mypy.ini", "--follow-imports", "silent"]
        cmd += ["--no-incremental", "--hide-error-context", "--no-error-summary", *rels]
        pattern = r"^(?P<file>[^:]+):\d+(?::\d+)?: (?:error|note): (?P<msg>.*)$"
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    found = []
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(pattern, line.strip())
        if m and m["file"].lstrip("./") in rels:
            # Messages that cite a line ("already defined on line 675") move with the patch
            msg = re.sub(r"\bline \d+", "line N", m["msg"])
            found.append(f"{m['file'].lstrip('./')}: {msg}")
    return found


def _code(finding: str) -> tuple[str, str]:
    """(file, code) of a finding: flake8's and ruff's leading code, pyrefly's
    and mypy's trailing ``[code]``, else the whole message."""
    file, msg = finding.split(": ", 1)
    m = re.search(r"\[([\w-]+)\]$", msg) or re.match(r"([A-Z]+\d+)\b", msg)
    return file, m.group(1) if m else msg


def _by_code(findings: collections.Counter[str]) -> collections.Counter[tuple[str, str]]:
    by_code: collections.Counter[tuple[str, str]] = collections.Counter()
    for finding, n in findings.items():
        by_code[_code(finding)] += n
    return by_code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lint-python", required=True, help="python of a venv with requirements-lint.txt"
    )
    parser.add_argument("--workspace", type=Path, help="default: .workspace/<installed torch>")
    parser.add_argument("--config-dir", type=Path, default=REPO / ".upstream-lint")
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    args = parser.parse_args()
    # The linters run with cwd in a scratch tree; absolute, not resolved (a venv's
    # python is a symlink out of the venv)
    args.lint_python = str(Path.cwd() / args.lint_python)

    import torch

    torch_dir = Path(torch.__file__).parent
    ws = args.workspace or REPO / ".workspace" / torch.__version__.split("+")[0]
    rels = [
        p
        for p in _git(ws, "diff", "--name-only", "base", "HEAD").split()
        if p.startswith(("torch/", "test/")) and p.endswith(".py")
    ]
    missing = [
        n for n in (".flake8", "pyrefly.toml", "mypy.ini") if not (args.config_dir / n).exists()
    ]
    if missing:
        sys.exit(f"{args.config_dir} lacks PyTorch's {missing}; see this tool's --help")
    counts: dict[str, dict[str, collections.Counter[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, rev in (("pristine", "base"), ("patched", "HEAD")):
            root = Path(tmp) / name
            files = {}
            for rel in rels:
                proc = subprocess.run(
                    ["git", "show", f"{rev}:{rel}"], cwd=ws, capture_output=True, text=True
                )
                if proc.returncode == 0:
                    files[rel] = proc.stdout
            torch_tree(torch_dir, root, files)
            present = [rel for rel in rels if rel in files]
            counts[name] = {
                tool: collections.Counter(
                    _findings(tool, args.lint_python, root, present, args.config_dir)
                )
                for tool in args.tools
            }
    new_total = 0
    for tool in args.tools:
        pristine, patched = counts["pristine"][tool], counts["patched"][tool]
        # A finding is new if its file has more of its code than pristine has;
        # otherwise a changed message is a pristine finding on an edited line
        # (e.g. an overload's signature, quoted in the message, gained a keyword)
        new_codes = _by_code(patched) - _by_code(pristine)
        differ = patched - pristine
        new = [f for f in sorted(differ.elements()) if _code(f) in new_codes]
        changed = [f for f in sorted(differ.elements()) if _code(f) not in new_codes]
        new_total += sum(new_codes.values())
        print(
            f"{tool}: pristine {pristine.total()}, patched {patched.total()}, "
            f"new {sum(new_codes.values())}"
        )
        for finding in new:
            print(f"  new: {finding}")
        for finding in changed:
            print(f"  changed (a pristine finding, reworded): {finding}")
    print(f"{len(rels)} torch/ and test/ files of {ws}")
    return 1 if new_total else 0


if __name__ == "__main__":
    sys.exit(main())
