"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with the ``patches/`` series applied.

``torch_fsdp_ext._fully_shard`` is generated from the installed torch's own
``torch/distributed/fsdp/_fully_shard`` plus the series; see ``_vendor``. A
module sharded here is also an instance of ``torch.distributed.fsdp.FSDPModule``.
"""

from ._vendor import ensure_vendored as _ensure_vendored

_ensure_vendored()

# Dynamo and pipelining must recognise our FSDP2 as they do torch's; see _torch_compat
from . import _torch_compat  # noqa: E402, F401
from ._clip_grad import clip_grad_norm_  # noqa: E402
from ._fully_shard import (  # noqa: E402
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from ._fully_shard._fsdp_backend import (  # noqa: E402
    FSDPBackend,
    get_fsdp_backend,
    register_fsdp_backend,
    unregister_fsdp_backend,
)
from ._fully_shard._fsdp_collectives import DeterministicReduceScatter  # noqa: E402
from ._fully_shard._fsdp_common import (  # noqa: E402
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)

__all__ = [
    "clip_grad_norm_",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "DeterministicReduceScatter",
    "FSDPBackend",
    "FSDPMeshInfo",
    "FSDPModule",
    "fully_shard",
    "get_fsdp_backend",
    "HSDPMeshInfo",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "register_fsdp_backend",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "ShardPlacementResult",
    "UnshardHandle",
    "unregister_fsdp_backend",
]

# New in torch 2.15: the handle of ``FSDPModule.finalize_backward(async_op=True)``
from . import _fully_shard as _vendored  # noqa: E402

if "GradientReductionHandle" in _vendored.__all__:
    from ._fully_shard import GradientReductionHandle  # noqa: F401

    __all__.append("GradientReductionHandle")
