#!/usr/bin/env python3
"""Count the runs in which gloo's coalesced all-gather, several in flight at
once, corrupts the heap: plain torch.distributed, no FSDP, nothing from this
project.

Each run is a fresh gloo job of ``--ranks`` processes on this host. Every
iteration each rank issues ``--ops`` asynchronous all-gathers of ``--tensors``
small tensors each (one dtype per op, values that name the rank, iteration,
op and tensor), allocates and frees small tensors on the main thread while
they run (``--compute``), then waits them one after the other and checks every
gathered value with ``torch.equal``. Every tensor handed to a collective stays
referenced until its work is waited on. ``--collective`` picks what issues an
op:

- ``pg`` (default): ``ProcessGroup.all_gather_single_coalesced`` (torch 2.9:
  ``allgather_into_tensor_coalesced``), i.e. c10d's
  ``allgather_into_tensor_coalesced``, run on gloo's worker threads as
  ``AsyncAllgatherCoalescedWork``;
- ``manager``: ``dist.all_gather_into_tensor`` calls inside
  ``dist._coalescing_manager(async_ops=True)``, which issues the same op;
- ``plain``: one ``dist.all_gather_into_tensor(async_op=True)`` per tensor
  (the control).

``--wait each`` waits every op right after issuing it, so one is in flight at
a time (the other control). ``--gloo-threads N`` builds gloo's backend
directly with N worker threads (torch's default is 2) and calls its methods.

A run counts as crashed when a rank dies by a signal (glibc's heap checks
abort with SIGABRT); as wrong when a gathered value differs; as hung when a
rank is still running after ``--timeout`` (gloo's own timeout is 60 s). The
ranks get ``MALLOC_PERTURB_`` (``--perturb``, another value each run) and,
with ``--malloc-check``, ``MALLOC_CHECK_=3`` with glibc's
``libc_malloc_debug.so.0`` preloaded (glibc 2.34+ ignores it otherwise).

Measured counts and the upstream report:
docs/upstream-gloo-coalesced-heap-corruption.md. Examples::

    python tools/probes/repro_gloo_coalesced_inflight.py --runs 8
    python tools/probes/repro_gloo_coalesced_inflight.py --runs 8 --wait each
    python tools/probes/repro_gloo_coalesced_inflight.py --runs 8 --collective plain

Exit status: 0 if every run finished with the right values, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

MALLOC_DEBUG_LIBS = (
    "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0",
    "/lib/aarch64-linux-gnu/libc_malloc_debug.so.0",
    "/usr/lib64/libc_malloc_debug.so.0",
)
GLIBC_MARKERS = ("malloc", "free(", "corrupted", "double free", "tcache", "fastbin")


def _value(rank: int, iteration: int, op: int, tensor: int) -> float:
    # differs between the ops and tensors of an iteration; exact in bf16 up to 16 ranks
    return float(16 * rank + (iteration + 5 * op + tensor) % 16)


def _rank(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import AllgatherOptions

    torch.set_num_threads(1)
    world, rank = args.ranks, args.rank
    store = dist.FileStore(args.store, world)
    if args.gloo_threads:
        # gloo's backend on its own, to set its number of worker threads
        options = dist.ProcessGroupGloo._Options()
        options._threads = args.gloo_threads
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = timedelta(seconds=60)
        group = dist.ProcessGroupGloo(store, rank, world, options)
    else:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, store=store, timeout=timedelta(seconds=60)
        )
        group = dist.group.WORLD
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]

    # torch 2.15 binds the op as all_gather_single_coalesced (gloo's backend too),
    # torch 2.9 only as ProcessGroup.allgather_into_tensor_coalesced
    coalesced = getattr(group, "all_gather_single_coalesced", None) or getattr(
        group, "allgather_into_tensor_coalesced", None
    )
    if coalesced is None and args.collective == "pg":
        sys.exit(f"this torch's {type(group).__name__} has no coalesced all-gather binding")

    def issue(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[dist.Work]:
        if args.collective == "pg":
            opts = AllgatherOptions()
            opts.asyncOp = True
            return [coalesced(outputs, inputs, opts)]
        if args.collective == "manager":
            with dist._coalescing_manager(group=group, async_ops=True) as cm:
                for out, inp in zip(outputs, inputs, strict=True):
                    dist.all_gather_into_tensor(out, inp, group=group)
            return [cm]
        if args.gloo_threads:
            opts = AllgatherOptions()
            opts.asyncOp = True
            return [
                group._allgather_base(out, inp, opts)
                for out, inp in zip(outputs, inputs, strict=True)
            ]
        return [
            dist.all_gather_into_tensor(out, inp, group=group, async_op=True)
            for out, inp in zip(outputs, inputs, strict=True)
        ]

    for it in range(args.iterations):
        ops = []  # (works, outputs, inputs): all stay referenced until waited
        for op in range(args.ops):
            dtype = dtypes[op % len(dtypes)]  # one dtype per op (see --dtypes)
            inputs = [
                torch.full((args.numel + t,), _value(rank, it, op, t), dtype=dtype)
                for t in range(args.tensors)
            ]
            outputs = [inp.new_empty(inp.numel() * world) for inp in inputs]
            works = issue(outputs, inputs)
            if args.wait == "each":
                for work in works:
                    work.wait()
            ops.append((works, outputs, inputs))
        scratch = []
        for k in range(args.compute):
            scratch.append(torch.randn(8 + k % 24) * 2.0)
            if len(scratch) > 4:
                scratch.pop(0)
        for op, (works, outputs, inputs) in enumerate(ops):
            for work in works:
                work.wait()
            for t, (out, inp) in enumerate(zip(outputs, inputs, strict=True)):
                expected = torch.cat(
                    [torch.full_like(inp, _value(r, it, op, t)) for r in range(world)]
                )
                if not torch.equal(out, expected):
                    print(f"WRONG VALUES rank {rank} iteration {it}", flush=True)
                    sys.exit(3)
    if not args.gloo_threads:
        dist.destroy_process_group()


def _run_once(args: argparse.Namespace, perturb: int) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if perturb:
        env["MALLOC_PERTURB_"] = str(perturb)
    if args.malloc_check:
        # glibc 2.34+ reads MALLOC_CHECK_ only with its debug library preloaded
        env["MALLOC_CHECK_"] = "3"
        debug_lib = next((p for p in MALLOC_DEBUG_LIBS if os.path.exists(p)), None)
        if debug_lib:
            env["LD_PRELOAD"] = debug_lib
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--store", os.path.join(tmp, "store")]
        for name in ("ranks", "iterations", "ops", "tensors", "numel", "compute"):
            cmd += [f"--{name}", str(getattr(args, name))]
        cmd += ["--collective", args.collective, "--wait", args.wait, "--dtypes", args.dtypes]
        cmd += ["--gloo-threads", str(args.gloo_threads)]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(args.ranks)
        ]
        outs, hung = [], []
        deadline = time.monotonic() + args.timeout
        for r, p in enumerate(procs):
            try:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate()[0])
                hung.append(r)
    codes = [p.returncode for p in procs]
    if all(c == 0 for c in codes):
        return "ok", ""
    if any("WRONG VALUES" in o for o in outs):
        return "wrong", next(o for o in outs if "WRONG VALUES" in o).strip()[-300:]
    first = []
    for r, (c, o) in enumerate(zip(codes, outs, strict=True)):
        if c < 0 and r not in hung:
            first.append(f"rank {r}: {signal.Signals(-c).name}")
        lines = [ln for ln in o.splitlines() if any(m in ln for m in GLIBC_MARKERS)]
        if lines:
            first.append(f"rank {r}: {lines[-1].strip()[:120]}")
    if first:
        return "crashed", "; ".join(first)
    if hung:
        return "hung", f"rank(s) {hung} still running after {args.timeout:.0f} s, killed"
    tail = "\n".join(o.strip()[-400:] for o in outs)
    return "failed", f"exit codes {codes}\n{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=10, help="jobs to run (default 10)")
    parser.add_argument("--ranks", type=int, default=2, help="processes per job (default 2)")
    parser.add_argument("--iterations", type=int, default=3000, help="per job (default 3000)")
    parser.add_argument("--ops", type=int, default=8, help="all-gathers per iteration (default 8)")
    parser.add_argument("--tensors", type=int, default=1, help="tensors per op (default 1)")
    parser.add_argument("--numel", type=int, default=16, help="elements per tensor (default 16)")
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="comma-separated dtypes, one per op, cycled (default float32); "
        "an op never mixes dtypes, so the wrong values of repro_gloo_coalesced_dtypes.py "
        "stay out",
    )
    parser.add_argument(
        "--compute",
        type=int,
        default=16,
        help="small tensors the main thread allocates while the ops run (default 16)",
    )
    parser.add_argument(
        "--collective", choices=("pg", "manager", "plain"), default="pg", help="default pg"
    )
    parser.add_argument(
        "--wait",
        choices=("all", "each"),
        default="all",
        help="all: every op of an iteration in flight at once (default); each: one at a time",
    )
    parser.add_argument(
        "--perturb",
        type=int,
        default=165,
        help="MALLOC_PERTURB_ of run i is (perturb + 37 i) %% 255 + 1 (default 165; 0: unset)",
    )
    parser.add_argument(
        "--gloo-threads",
        type=int,
        default=0,
        help="worker threads of gloo's backend, built directly (default 0: init_process_group's "
        "backend, 2 threads; pg and plain then call the backend's own methods)",
    )
    parser.add_argument(
        "--malloc-check",
        action="store_true",
        help="also set MALLOC_CHECK_=3, with glibc's libc_malloc_debug.so.0 preloaded if found",
    )
    parser.add_argument("--timeout", type=float, default=150, help="seconds per job (default 150)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_threads and args.collective == "manager":
        parser.error("--gloo-threads needs --collective pg or plain")
    if args.rank is not None:
        _rank(args)
        return 0

    import torch

    print(
        f"torch {torch.__version__}, gloo, {args.ranks} ranks, collective={args.collective}, "
        f"wait={args.wait}, {args.ops} ops x {args.tensors} tensors ({args.dtypes}), "
        f"{args.iterations} iterations, compute={args.compute}"
        + (f", {args.gloo_threads} gloo threads" if args.gloo_threads else "")
        + (", MALLOC_CHECK_=3" if args.malloc_check else ""),
        flush=True,
    )
    if args.malloc_check and not any(os.path.exists(p) for p in MALLOC_DEBUG_LIBS):
        print("note: no libc_malloc_debug.so.0 found; glibc 2.34+ ignores MALLOC_CHECK_")
    counts: dict[str, int] = {}
    start = time.monotonic()
    for i in range(args.runs):
        perturb = (args.perturb + 37 * i) % 255 + 1 if args.perturb else 0
        run_start = time.monotonic()
        outcome, detail = _run_once(args, perturb)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(
            f"run {i + 1} (MALLOC_PERTURB_={perturb or 'unset'}, "
            f"{time.monotonic() - run_start:.0f} s): {outcome} {detail}".rstrip(),
            flush=True,
        )
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    print(f"{args.runs} runs in {time.monotonic() - start:.0f} s: {summary}", flush=True)
    return 0 if counts.get("ok", 0) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
