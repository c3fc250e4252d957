"""How a TorchTPU-like backend gives FSDP its defaults, so user code stays ``fully_shard(block)``.

TorchTPU ships as ``torch_tpu``: a PrivateUse1 backend renamed ``"tpu"``. Its
package would carry this module and the entry point in this example's
``pyproject.toml``; torch_fsdp_ext calls :func:`register` the first time FSDP
looks up a backend, so nothing in a training script changes. On TPU, copies into
group-wide buffers are costly, hence ``group_collectives=False`` by default, and
the backend's own comms receive each parameter's tensors.

What runs here (no TPU): entry-point discovery registers ``"tpu"`` in a
process that renamed PrivateUse1 to ``"tpu"``, and the same :func:`register`
called for ``"cpu"`` trains on CPU with these comms. The comms below call
c10d; a real backend would call its own collectives instead.
"""

import torch
import torch.distributed as dist

from torch_fsdp_ext import FSDPBackend, register_fsdp_backend
from torch_fsdp_ext._fully_shard._fsdp_api import AllGather, ReduceScatter


class TPUAllGather(AllGather):
    """Owns allocation and the collective of each per-parameter all-gather."""

    # Per-parameter mode may gather into the parameters' own storage
    accepts_parameter_output = True
    calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        type(self).calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class TPUReduceScatter(ReduceScatter):
    """Receives each gradient itself (``accepts_gradient_input``) in per-parameter mode."""

    accepts_gradient_input = True
    calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        type(self).calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


def register(device_type: str = "tpu") -> None:
    """The entry point: declare FSDP defaults for ``device_type``.

    Entry points load in every process that uses FSDP, so this must not fail
    where the device is absent: torch_tpu renames PrivateUse1 to ``"tpu"``
    when it is imported; without that there is nothing to register.
    """
    if device_type == "tpu" and torch._C._get_privateuse1_backend_name() != "tpu":
        return
    register_fsdp_backend(
        device_type,
        FSDPBackend(
            group_collectives=False,
            all_gather_comm=TPUAllGather,
            reduce_scatter_comm=TPUReduceScatter,
            # Like gloo and XCCL: divide factors reduce with SUM, FSDP divides
            supports_premul_sum=False,
            supports_coalescing=False,
        ),
        override=device_type == "cpu",  # "cpu" has built-in capabilities
    )
