"""How a TorchTPU-like backend gives FSDP its defaults, so user code stays ``fully_shard(block)``.

TorchTPU ships as ``torch_tpu``: a PrivateUse1 backend renamed ``"tpu"``,
which torch autoloads at ``import torch`` through its ``torch.backends`` entry
point. Its package would carry this module, and its autoload hook would call
:func:`register` (:func:`autoload` here, named in this example's
``pyproject.toml``), so nothing in a training script changes. On TPU, copies into
group-wide buffers are costly, hence ``group_collectives=False`` by default.

The comms receive each parameter group's per-parameter collectives in one
``foreach`` call, on FSDP's own tensors, and issue them as one fused
collective over buffers from their own ``allocate``, as TorchTPU's ``torch.ops.tpu._reduce_scatter_dim``
or a torchcomms batch would. Here the fused collectives are c10d calls over
packed buffers, so the example runs on CPU with gloo:

- all-gather: the group's shards packed as bytes, one all-gather, unpacked;
- reduce-scatter: per gradient dtype, each rank's chunk of every gradient
  packed, one all-to-all, then a sum in rank order, so the result is the same
  bits at any world size (those of ``DeterministicReduceScatter``).

What runs here (no TPU): torch's autoload registers ``"tpu"``, and the same
:func:`register` called for ``"cpu"`` trains on CPU with these comms.
"""

import torch
import torch.distributed as dist

from torch_fsdp_ext import FSDPBackend, register_fsdp_backend
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter

ReduceOp = dist.ReduceOp


class TPUAllGather(AllGather):
    """All-gathers a parameter group with one fused collective."""

    def allocate(self, size, *, dtype, device):
        # A real backend allocates from its own allocator (e.g. device HBM pools)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        # Grouped mode: the group's one flat buffer
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)

    def foreach(self, output_tensors, input_tensors, group, async_op=False):
        world_size = group.size()
        # All-gather moves bytes, so one byte buffer serves any mix of dtypes
        inputs = [t.reshape(-1).view(torch.uint8) for t in input_tensors]
        nbytes = [t.numel() for t in inputs]
        device = input_tensors[0].device
        packed_input = self.allocate((sum(nbytes),), dtype=torch.uint8, device=device)
        torch.cat(inputs, out=packed_input)
        packed_output = self.allocate((world_size * sum(nbytes),), dtype=torch.uint8, device=device)
        dist.all_gather_into_tensor(packed_output, packed_input, group)
        per_rank = packed_output.view(world_size, -1).split(nbytes, dim=1)
        for output, gathered in zip(output_tensors, per_rank, strict=True):
            output.view(torch.uint8).view(world_size, -1).copy_(gathered)
        return None


class TPUReduceScatter(ReduceScatter):
    """Reduce-scatters a parameter group's gradients with one fused collective
    per gradient dtype, summing in rank order."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        # Grouped mode: the group's one flat buffer
        self._reduce_scatter_fused([output_tensor], [input_tensor], group, op)
        return None

    def foreach(self, output_tensors, input_tensors, group, op, async_op=False):
        self._reduce_scatter_fused(output_tensors, input_tensors, group, op)
        return None

    def _reduce_scatter_fused(self, output_tensors, input_tensors, group, op) -> None:
        world_size = group.size()
        indices_by_dtype: dict[torch.dtype, list[int]] = {}
        for i, input_tensor in enumerate(input_tensors):
            indices_by_dtype.setdefault(input_tensor.dtype, []).append(i)
        for dtype, indices in indices_by_dtype.items():
            chunk_numels = [input_tensors[i].numel() // world_size for i in indices]
            device = input_tensors[indices[0]].device
            # Row r holds rank r's chunk of every gradient
            packed = self.allocate((world_size, sum(chunk_numels)), dtype=dtype, device=device)
            torch.cat([input_tensors[i].view(world_size, -1) for i in indices], dim=1, out=packed)
            received = self.allocate(packed.size(), dtype=dtype, device=device)
            dist.all_to_all_single(received, packed, group=group)
            reduced = self.allocate((sum(chunk_numels),), dtype=dtype, device=device)
            _sum_in_rank_order(received, op, world_size, out=reduced)
            for i, part in zip(indices, reduced.split(chunk_numels), strict=True):
                output_tensors[i].copy_(part)


def _sum_in_rank_order(received: torch.Tensor, op, world_size: int, *, out: torch.Tensor) -> None:
    red_op = getattr(op, "op", op)  # a ``ReduceOp`` instance or a ``RedOpType``
    if red_op == ReduceOp.PREMUL_SUM:
        received.mul_(op.factor)
    elif red_op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise NotImplementedError(f"TPUReduceScatter supports SUM, AVG and PREMUL_SUM, not {op}")
    out.copy_(received[0])
    for row in received[1:]:
        out.add_(row)
    if red_op == ReduceOp.AVG:
        out.div_(world_size)


def register(device_type: str = "tpu") -> None:
    """Declare FSDP defaults for ``device_type``."""
    register_fsdp_backend(
        device_type,
        FSDPBackend(
            group_collectives=False,
            all_gather_comm=TPUAllGather,
            reduce_scatter_comm=TPUReduceScatter,
        ),
    )


def autoload() -> None:
    """The ``torch.backends`` entry point, which torch calls at the end of
    ``import torch`` (device-backend autoload): as torch_tpu's would, it
    names PrivateUse1 ``"tpu"`` and registers the FSDP defaults, so FSDP
    needs no discovery of its own."""
    if torch._C._get_privateuse1_backend_name() != "tpu":
        torch.utils.rename_privateuse1_backend("tpu")
    register()
