"""Benchmark FSDP2 side by side: upstream, grouped and per-parameter collectives.

For each process group and world size, each model is sharded five ways from
the same seed and trained in one run:

  upstream              torch.distributed.fsdp.fully_shard
  grouped               torch_fsdp_ext.fully_shard(..., group_collectives=True)
  per-param             torch_fsdp_ext.fully_shard(..., group_collectives=False),
                        a group's collectives coalesced (dist._coalescing_manager)
  per-param-nocoalesce  the same, one collective after another
  deterministic         per-param with DeterministicReduceScatter on every module

Coalescing is chosen through the public FSDP backend registry: around the
steps of a per-parameter mode, the bench registers for the device type a copy
of its FSDPBackend with supports_coalescing set to the mode's choice (False
for per-param-nocoalesce, True otherwise), and restores the previous
registration afterwards. On the fake process group this makes per-param and
deterministic run the coalesced code path, and the same on gloo (the package
itself coalesces only where the process group's backend reports
supports_coalescing: NCCL, not gloo or "fake").

Metrics per mode: median, quartiles and min/max of the step time (forward,
backward, AdamW step, zero_grad; the max over ranks of each step), also as a
ratio to upstream; FSDP-side copy bytes counted by dispatch (bytes written by
copy ops issued from FSDP's own code); peak bytes allocated in forward and in
backward (the exact profiler method of test/package/test_per_param_memory.py
on CPU, CUDA memory stats on GPU); number and bytes of collectives.

Models: two Llama-like transformers (torch_fsdp_ext/_testing/models.py's, scaled to CPU), the
residual MLP stack of the memory test, a group of many small parameters
(64 of 64x64), a group of few large ones (2 of 2048x2048), a sweep of one
group of n params at a fixed total size, and the MoE transformer of
tools/demos/moe.py (at its default sizes) with expert parallelism on a 2-D
(efsdp, ep=2) mesh. For the MoE model, upstream shards each block's experts
(Shard(1) on efsdp) and then the block apart; the other modes shard each
block once, expert parameters on the efsdp mesh. It runs where ep divides the
world size into at least two efsdp ranks.

Process groups: gloo (one process per rank), the fake process group (one
process; collectives move no data, so it measures FSDP's own work: copies,
allocations, Python and launch time) and NCCL on CUDA.

Every rank runs one intra-op thread by default (--threads). Writes
OUT/bench.json (or --json PATH), OUT/bench.md (also printed) and PNG plots
(time, memory, copies, sweep) in OUT/, bench-out/ by default; --profile adds
torch.profiler tables and memory-peak sites in OUT/profiles/.
Results and commands for this repository's machine: docs/benchmarks.md.
"""
