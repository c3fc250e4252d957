"""Run torchtitan's FSDP2 through ``torch_fsdp_ext.fully_shard``.

Every decoder of torchtitan 0.3 (llama3, qwen3, deepseek_v3, gpt_oss, ...)
shards itself in ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``, which
calls the ``fully_shard`` that module imported from ``torch.distributed.fsdp``.
Switching torchtitan over is therefore one rebinding of that name, which this
module does for you, in one of two ways:

* From the command line, with torchtitan's own override mechanism (one flag)::

      torchrun ... -m torchtitan.train --module llama3 --config llama3_8b \\
          --override.imports 'torch_fsdp_ext.torchtitan.fsdp_ext={"group_collectives": false}'

  or, in your own ``config_registry`` function,
  ``config.override.imports.append(("torch_fsdp_ext.torchtitan.fsdp_ext",
  {"group_collectives": False}))``. The trainer applies it before it
  parallelizes the model.

* From Python, before the model is parallelized::

      from torch_fsdp_ext.torchtitan import use_fsdp_ext

      use_fsdp_ext(group_collectives=False)  # for the rest of the process
      with use_fsdp_ext(group_collectives=False):  # or only inside the block
          model = model_spec.parallelize_fn(model, ...)

Everything torchtitan passes (mesh, mixed precision, CPU offload,
``shard_placement_fn`` returning torch's ``ShardPlacementResult`` for expert
parallelism, ``dp_mesh_dims``) reaches ``torch_fsdp_ext.fully_shard``
unchanged in meaning; torch's policy classes are converted to ours. The
modules it returns are also ``torch.distributed.fsdp.FSDPModule`` instances,
so torchtitan's ``isinstance`` checks and setters keep working.

Only code that calls ``apply_fsdp_to_decoder`` or
``apply_fsdp_to_vision_encoder`` is switched; flux and the experiments that
import ``fully_shard`` themselves keep torch's.

The harness that runs torchtitan's debug models on CPU ranks for the tests
and the demo is ``fsdp_ext_testing.torchtitan``, not user API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.distributed.fsdp as _upstream_fsdp
import torch.nn as nn
import torchtitan
import torchtitan.distributed.fsdp as _titan_fsdp
from torchtitan.config import override
from torchtitan.protocols.model import BaseModel

import torch_fsdp_ext

__all__ = [
    "FSDPExtSettings",
    "SUPPORTED_TORCHTITAN",
    "TorchtitanLayoutError",
    "active_settings",
    "fsdp_ext",
    "use_fsdp_ext",
]

# The torchtitan releases whose layout this module was written against
SUPPORTED_TORCHTITAN = "0.3"
# The module whose ``fully_shard`` global every decoder's FSDP goes through
_TARGET = "torchtitan.distributed.fsdp"
# The functions there that call it
_CALLERS = ("apply_fsdp_to_decoder", "apply_fsdp_to_vision_encoder")
# Marks our wrapper; holds its FSDPExtSettings
_SETTINGS_ATTR = "_torch_fsdp_ext_settings"


class TorchtitanLayoutError(RuntimeError):
    """The installed torchtitan is not laid out as this module expects."""


@dataclasses.dataclass(frozen=True)
class FSDPExtSettings:
    """What torchtitan's ``fully_shard`` calls get on top of torchtitan's own arguments.

    ``group_collectives`` goes to every :func:`torch_fsdp_ext.fully_shard`
    call that does not pass its own (``None``: the default of the FSDP backend
    registered for the device type, else grouped).
    ``deterministic_reduce_scatter`` gives every FSDP module
    :class:`torch_fsdp_ext.DeterministicReduceScatter`, which makes gradients
    bitwise equal across ``group_collectives`` modes at any world size.
    """

    group_collectives: bool | None = None
    deterministic_reduce_scatter: bool = False

    def __post_init__(self) -> None:
        # Catch a wrong type here, not at the first fully_shard deep inside parallelize
        if self.group_collectives is not None and not isinstance(self.group_collectives, bool):
            raise TypeError(
                f"group_collectives must be a bool or None but got {self.group_collectives!r}"
            )
        if not isinstance(self.deterministic_reduce_scatter, bool):
            raise TypeError(
                "deterministic_reduce_scatter must be a bool but got "
                f"{self.deterministic_reduce_scatter!r}"
            )


def _check_layout() -> None:
    """Raises :class:`TorchtitanLayoutError` unless torchtitan is a supported
    release whose FSDP module calls a ``fully_shard`` we can rebind."""
    version = getattr(torchtitan, "__version__", "unknown")
    if version.split(".")[:2] != SUPPORTED_TORCHTITAN.split("."):
        raise TorchtitanLayoutError(
            f"torch_fsdp_ext.torchtitan supports torchtitan {SUPPORTED_TORCHTITAN}.x, "
            f"found {version}: check that {_TARGET} still calls a module-level "
            f"fully_shard from {', '.join(_CALLERS)} and update SUPPORTED_TORCHTITAN"
        )
    missing = [name for name in (*_CALLERS, "fully_shard") if not hasattr(_titan_fsdp, name)]
    current = getattr(_titan_fsdp, "fully_shard", None)
    if missing or not (current is _upstream_fsdp.fully_shard or hasattr(current, _SETTINGS_ATTR)):
        raise TorchtitanLayoutError(
            f"{_TARGET} no longer has the layout torch_fsdp_ext.torchtitan rebinds "
            f"(missing: {missing or 'none'}; fully_shard is {current!r}, expected "
            "torch.distributed.fsdp.fully_shard): torchtitan changed, or something "
            "else already replaced its fully_shard"
        )


def _to_ext(value: Any) -> Any:
    """torch's FSDP policy and mesh-dims objects as ours (same fields).

    Our copy checks ``isinstance(offload_policy, CPUOffloadPolicy)`` against
    its own class, so torch's ``CPUOffloadPolicy`` would silently not offload.
    """
    for upstream_cls, ext_cls in (
        (_upstream_fsdp.MixedPrecisionPolicy, torch_fsdp_ext.MixedPrecisionPolicy),
        (_upstream_fsdp.CPUOffloadPolicy, torch_fsdp_ext.CPUOffloadPolicy),
        (_upstream_fsdp.OffloadPolicy, torch_fsdp_ext.OffloadPolicy),
        # Not in torch 2.9
        (
            getattr(_upstream_fsdp, "DataParallelMeshDims", None),
            getattr(torch_fsdp_ext, "DataParallelMeshDims", None),
        ),
    ):
        if upstream_cls is not None and type(value) is upstream_cls:
            fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
            return ext_cls(**fields)
    return value


def _make_fully_shard(settings: FSDPExtSettings) -> Callable[..., Any]:
    def fully_shard(module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
        kwargs = {name: _to_ext(value) for name, value in kwargs.items()}
        kwargs.setdefault("group_collectives", settings.group_collectives)
        sharded = torch_fsdp_ext.fully_shard(module, **kwargs)
        if settings.deterministic_reduce_scatter:
            for m in module if isinstance(module, list) else [module]:
                # One per param group: MoE blocks have one per mesh
                m.set_custom_reduce_scatter(
                    lambda group: torch_fsdp_ext.DeterministicReduceScatter()
                )
        return sharded

    fully_shard.__doc__ = f"torch_fsdp_ext.fully_shard with {settings} (torch_fsdp_ext.torchtitan)"
    setattr(fully_shard, _SETTINGS_ATTR, settings)
    return fully_shard


class FSDPExtHandle:
    """Returned by :func:`use_fsdp_ext`: :meth:`restore` (or leaving the
    ``with`` block) puts back the ``fully_shard`` torchtitan had before."""

    def __init__(self, settings: FSDPExtSettings, previous: Callable[..., Any]):
        self.settings = settings
        self._previous = previous
        self._installed = _titan_fsdp.fully_shard

    def restore(self) -> None:
        if _titan_fsdp.fully_shard is not self._installed:
            raise RuntimeError(
                f"{_TARGET}.fully_shard was rebound again after this use_fsdp_ext; "
                "restore the later one first"
            )
        _titan_fsdp.fully_shard = self._previous

    def __enter__(self) -> FSDPExtHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def use_fsdp_ext(
    group_collectives: bool | None = None, *, deterministic_reduce_scatter: bool = False
) -> FSDPExtHandle:
    """Make torchtitan's FSDP2 (``apply_fsdp_to_decoder`` and
    ``apply_fsdp_to_vision_encoder``) call :func:`torch_fsdp_ext.fully_shard`
    with ``group_collectives`` (see :class:`FSDPExtSettings`).

    Call it before the model is parallelized. It rebinds
    ``torchtitan.distributed.fsdp.fully_shard`` for the whole process; use the
    returned handle as a context manager, or call its ``restore()``, to go
    back. Calling it again replaces the settings. Raises
    :class:`TorchtitanLayoutError` if torchtitan is not 0.3.x or no longer
    routes its FSDP through that name.
    """
    settings = FSDPExtSettings(group_collectives, deterministic_reduce_scatter)
    _check_layout()
    previous = _titan_fsdp.fully_shard
    _titan_fsdp.fully_shard = _make_fully_shard(settings)
    return FSDPExtHandle(settings, previous)


def active_settings() -> FSDPExtSettings | None:
    """The settings torchtitan's FSDP runs with, or ``None`` for torch's ``fully_shard``."""
    return getattr(getattr(_titan_fsdp, "fully_shard", None), _SETTINGS_ATTR, None)


@override(target=BaseModel.Config, description="FSDP2 through torch_fsdp_ext.fully_shard")
def fsdp_ext(
    config: BaseModel.Config,
    *,
    group_collectives: bool | None = None,
    deterministic_reduce_scatter: bool = False,
) -> BaseModel.Config:
    """The ``--override.imports`` form of :func:`use_fsdp_ext`.

    torchtitan's override mechanism hands each activated override the config
    nodes it claims, in ``Trainer.__init__`` before ``parallelize_fn``. This
    one claims the model config (``model_spec.model``; any model config, so
    that a moved one is still found) only as its hook into that moment: it
    calls :func:`use_fsdp_ext` with the kwargs of the ``override.imports``
    entry and returns the config unchanged.
    """
    use_fsdp_ext(group_collectives, deterministic_reduce_scatter=deterministic_reduce_scatter)
    return config
