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
    FSDPBackend,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    get_fsdp_backend,
    register_fsdp_backend,
    register_fsdp_forward_method,
    unregister_fsdp_backend,
)

# A test utility upstream (torch.testing._internal.common_fsdp), generated from there
from ._fully_shard._deterministic import DeterministicReduceScatter  # noqa: E402
from ._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo  # noqa: E402

__all__ = [
    "clip_grad_norm_",
    "CPUOffloadPolicy",
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
    "UnshardHandle",
    "unregister_fsdp_backend",
]

# What the installed torch's FSDP2 has: ``DataParallelMeshDims``,
# ``share_comm_ctx`` and ``ShardPlacementResult`` are not in torch 2.9;
# ``GradientReductionHandle`` (of ``FSDPModule.finalize_backward(async_op=True)``)
# is new in torch 2.15
from . import _fully_shard as _vendored  # noqa: E402
from ._fully_shard import _fsdp_common as _vendored_common  # noqa: E402

for _name in ("DataParallelMeshDims", "GradientReductionHandle", "share_comm_ctx"):
    if _name in _vendored.__all__:
        globals()[_name] = getattr(_vendored, _name)
        __all__.append(_name)
if hasattr(_vendored_common, "ShardPlacementResult"):
    ShardPlacementResult = _vendored_common.ShardPlacementResult
    __all__.append("ShardPlacementResult")
del _name
