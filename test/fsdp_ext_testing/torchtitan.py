"""torchtitan's debug models on CPU ranks (gloo), shared by
``test/package/test_torchtitan.py``, ``test/package/test_torchtitan_compositions.py``
and ``tools/demos/torchtitan_moe.py``: the CPU shims (:func:`apply_cpu_shims`),
CPU-sized debug configs (:func:`debug_config`) and :class:`DebugRun`, which
trains a model built and parallelized by torchtitan's own code, switched to
``torch_fsdp_ext.fully_shard`` with :func:`torch_fsdp_ext.torchtitan.use_fsdp_ext`.
None of it is needed on GPUs, and none of it is user API.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.fsdp as _upstream_fsdp
import torch.nn as nn

from torch_fsdp_ext.torchtitan import FSDPExtSettings, use_fsdp_ext

__all__ = ["apply_cpu_shims", "debug_config", "DebugRun"]


def apply_cpu_shims(config: Any) -> None:
    """Make a torchtitan ``Trainer.Config`` train on CPU ranks over gloo.

    Every CPU-only workaround lives here. None of them concerns FSDP; FSDP's
    gloo knob, for both arms, is :func:`_force_sum_reduction`.
    """
    from torchtitan.distributed import parallel_dims
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    # 1. Device type. torchtitan.tools.utils picks ``_get_available_device_type()
    #    or "cuda"``, so without an accelerator it says "cuda" and ParallelDims
    #    would build its meshes on CUDA. ParallelDims is its only user on this path.
    parallel_dims.device_type = "cpu"
    # 2. Attention. torch refuses FlexAttention's backward on CPU; use SDPA
    #    (causal, so DebugRun passes no document masks).
    model_config = config.model_spec.model
    for _, _, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    # 3. Expert parallelism. Under the default spmd_types backend the token
    #    all-to-all fails on gloo ("alltoall: invalid tensor size");
    #    partial_dtensor (DTensor for model-parallel axes only) runs.
    if config.parallelism.expert_parallel_degree > 1:
        config.parallelism.spmd_backend = "partial_dtensor"


def _force_sum_reduction(model: nn.Module) -> None:
    """FSDP2 reduce-scatters with ``PREMUL_SUM`` once torchtitan sets a
    gradient divide factor (1.0), which gloo lacks ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"); force SUM, as a user on gloo would, in
    both arms (ours subclasses torch's ``FSDPModule``)."""
    for module in model.modules():
        if isinstance(module, _upstream_fsdp.FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def debug_config(
    model: str,
    *,
    ep: int = 1,
    seq_len: int = 64,
    local_batch_size: int = 2,
    steps: int = 10,
    param_dtype: str = "bfloat16",
) -> Any:
    """``<model>_debugmodel()`` from torchtitan's config registry, sized for
    CPU ranks (shorter sequences and batches) and with :func:`apply_cpu_shims`."""
    registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
    config = getattr(registry, f"{model}_debugmodel")()
    config.training.seq_len = seq_len
    config.training.local_batch_size = local_batch_size
    config.training.steps = steps
    config.training.mixed_precision_param = param_dtype
    config.parallelism.expert_parallel_degree = ep
    apply_cpu_shims(config)
    return config


class DebugRun:
    """One model built from ``config.model_spec`` (torchtitan's registry),
    parallelized by its ``parallelize_fn``, and trained by the steps of
    ``Trainer.train_step`` without the data loader, metrics and checkpoints.

    ``fsdp`` picks the ``fully_shard``: ``None`` for torch's, else
    :class:`FSDPExtSettings`. ``parallel_dims`` is shared between the runs of a process (torchtitan's
    spmd_types backend keeps the meshes of the first in module state).
    Parameters are initialized from ``seed``.
    """

    def __init__(
        self,
        config: Any,
        parallel_dims: Any,
        fsdp: FSDPExtSettings | None,
        *,
        seed: int = 42,
    ):
        from torchtitan.components.loss import ChunkedLossWrapper
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools import utils

        self.config = config
        self.parallel_dims = parallel_dims
        # As Trainer.init_distributed: one autograd thread for AC's recompute
        torch.autograd.set_multithreading_enabled(False)
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        spec = config.model_spec
        # Trainer.__init__ updates the registry's model config in place; each run its own copy
        model_config = copy.deepcopy(spec.model)
        model_config.update_from_config(config=config)
        self.model_config = model_config
        with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
            model = model_config.build()
        switch = (
            contextlib.nullcontext()
            if fsdp is None
            else use_fsdp_ext(
                fsdp.group_collectives,
                deterministic_reduce_scatter=fsdp.deterministic_reduce_scatter,
            )
        )
        with switch:
            model = spec.parallelize_fn(
                model,
                parallel_dims=parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=config.activation_checkpoint,
                dump_folder=config.dump_folder,
            )
        _force_sum_reduction(model)
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model = model
        self.loss_fn = config.loss.build(compile_config=config.compile)
        if isinstance(self.loss_fn, ChunkedLossWrapper):
            self.loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        self.optimizers = config.optimizer.build(model_parts=[model])
        if spec.post_optimizer_build_fn is not None:
            spec.post_optimizer_build_fn(self.optimizers, [model], parallel_dims)
        self.lr_schedulers = config.lr_scheduler.build(
            optimizers=self.optimizers, training_steps=config.training.steps
        )
        self.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)

    def step(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on this rank's ``tokens`` (batch, seq_len + 1);
        returns the global loss and the gradient norm before clipping."""
        from torchtitan.distributed import utils as dist_utils

        parallel_dims, config = self.parallel_dims, self.config
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        extra_kwargs: dict[str, Any] = {}
        if config.parallelism.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, extra_kwargs = annotate_input_spmd_types(
                parallel_dims, inputs, labels, extra_kwargs
            )
        self.optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
        local_valid_tokens = torch.tensor(labels.numel(), dtype=torch.int64)
        global_valid_tokens = dist_utils.dist_sum_tensor(
            local_valid_tokens, parallel_dims.get_mesh("batch")
        )
        with self.train_context():
            pred = self.model(inputs, **extra_kwargs)
            loss, _ = self.loss_fn(pred, labels, global_valid_tokens)
            del pred
            loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(self.model.parameters()),
            config.training.max_norm,
            foreach=True,
            ep_enabled=parallel_dims.ep_enabled,
        )
        self.optimizers.step()
        self.lr_schedulers.step()
        # The global loss as Trainer.train_step logs it: the sum over the loss mesh
        loss = dist_utils.dist_sum_tensor(loss.detach(), parallel_dims.get_optional_mesh("loss"))
        return loss, grad_norm

    def local_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's shard of every parameter, by name."""
        for name, param in self.model.named_parameters():
            yield name, param.to_local() if hasattr(param, "to_local") else param
