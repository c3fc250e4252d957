"""Benchmark FSDP2 side by side: upstream, grouped and per-parameter collectives.

For each process group and world size, each model is sharded five ways from
the same seed and trained in one run:

  upstream              torch.distributed.fsdp.fully_shard
  grouped               torch_fsdp_ext.fully_shard(..., group_collectives=True)
  per-param             torch_fsdp_ext.fully_shard(..., group_collectives=False),
                        a group's collectives coalesced (one c10d op per group)
  per-param-nocoalesce  the same, one collective after another
  deterministic         per-param with DeterministicReduceScatter on every module

Coalescing is chosen through the public FSDP backend registry: while a
per-parameter mode's model is sharded, the bench registers for the device type
a copy of its FSDPBackend whose default comms coalesce a group's collectives
(per-param, deterministic) or issue them one by one (per-param-nocoalesce),
from fsdp_ext_testing.coalescing, and restores the previous registration
afterwards. The package's own comms coalesce where the process group's backend
reports supports_coalescing (NCCL, which a coalesced mode keeps; not gloo nor
the fake process group).

Metrics per mode: median, quartiles and min/max of the step time (forward,
backward, AdamW step, zero_grad; the max over ranks of each step), also as a
ratio to upstream and to grouped; FSDP's own time in each step (the time
inside FSDP2's hooks less the process group's calls and waits made from them:
fsdp_time.py) and that process-group time; FSDP-side copy bytes counted by
dispatch (bytes written by copy ops issued from FSDP's own code); peak bytes
allocated in forward, in backward and inside FSDP's gradient reductions (the
exact profiler method of test/package/test_per_param_memory.py on CPU, CUDA
memory stats on GPU, where the reduction peak is not measured); number and
bytes of collectives.

Models: two Llama-like transformers (test/fsdp_ext_testing/models.py's, scaled to CPU), the
residual MLP stack of the memory test, a group of many small parameters
(64 of 64x64), a group of few large ones (2 of 2048x2048), a sweep of one
group of n params at a fixed total size, and the MoE transformer of
tools/demos/moe.py (at its default sizes) with expert parallelism on a 2-D
(efsdp, ep=2) mesh. For the MoE model, upstream shards each block's experts
(Shard(1) on efsdp) and then the block apart; the other modes shard each
block once, expert parameters on the efsdp mesh. It runs where ep divides the
world size into at least two efsdp ranks.

Process groups: gloo (one process per rank), the fake process group (one
process, W ranks simulated: its all-gather copies the input into every rank's
chunk of the output and its reduce-scatter copies one chunk, per tensor, so
its time is reported apart from FSDP's own) and NCCL on CUDA.

Every rank runs one intra-op thread by default (--threads). Writes
OUT/bench.json (or --json PATH), OUT/bench.md (also printed) and PNG plots
(time, memory, copies, sweep) in OUT/, bench-out/ by default; --profile adds
torch.profiler tables and memory-peak sites in OUT/profiles/.
Results and commands for this repository's machine: docs/results.md.
"""

import sys
from pathlib import Path

# The models and measurements the bench shares with the tests (fsdp_ext_testing)
sys.path.insert(1, str(Path(__file__).resolve().parents[2] / "test"))
