"""Runs: the suite of one process group and world size on each rank (every
model in every mode, then the sweep), and how the ranks start: one process
per rank through ``mp.spawn`` for gloo and NCCL, this process alone for the
fake process group."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .measure import RunConfig, bench_model
from .models import MODELS, sweep_spec
from .modes import SWEEP_MODES, model_modes
from .report import loadavg

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(message)s"


def _run_suite(rank: int, cfg: RunConfig) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads)
    # Fake all-gathers leave parameters uninitialized; flushing denormals
    # keeps garbage values from slowing down the math (applied in every run)
    torch.set_flush_denormal(True)
    if cfg.device == "cuda":
        device = torch.device("cuda", rank if cfg.pg != "fake" else 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    run: dict[str, Any] = {
        "pg": cfg.pg,
        "world_size": cfg.world_size,
        "device": str(device.type),
        "mp": cfg.mp,
        "threads_per_rank": cfg.threads,
        "warmup_steps": cfg.warmup,
        "timed_steps": cfg.steps,
        "loadavg_start": loadavg(),
        "models": [],
        "sweep": [],
    }
    start = time.perf_counter()
    for name in cfg.models:
        if rank == 0:
            log.info("  %s W=%d: %s", cfg.pg, cfg.world_size, name)
        run["models"].append(
            bench_model(MODELS[name], model_modes(), cfg, rank, device, memory=True)
        )
    for num_params in cfg.sweep:
        if rank == 0:
            log.info("  %s W=%d: sweep, %d params per group", cfg.pg, cfg.world_size, num_params)
        run["sweep"].append(
            bench_model(sweep_spec(num_params), SWEEP_MODES, cfg, rank, device, memory=False)
        )
    run["wall_s"] = time.perf_counter() - start
    run["loadavg_end"] = loadavg()
    return run


def _worker(rank: int, cfg: RunConfig, store_path: str, result_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, cfg.world_size)
    dist.init_process_group(cfg.pg, rank=rank, world_size=cfg.world_size, store=store)
    try:
        run = _run_suite(rank, cfg)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(result_path).write_text(json.dumps(run))


def launch(cfg: RunConfig) -> dict[str, Any]:
    """Runs the suite of ``cfg`` on its ranks and returns rank 0's JSON entry."""
    log.info(
        "%s W=%d on %s, %d thread(s) per rank, %d warm-up + %d timed steps",
        cfg.pg,
        cfg.world_size,
        cfg.device,
        cfg.threads,
        cfg.warmup,
        cfg.steps,
    )
    if cfg.pg == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.world_size)
        try:
            return _run_suite(0, cfg)
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(
            _worker,
            args=(cfg, os.path.join(tmp, "store"), result_path),
            nprocs=cfg.world_size,
            join=True,
        )
        return json.loads(Path(result_path).read_text())
