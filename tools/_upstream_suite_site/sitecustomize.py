"""Process setup for ``tools/upstream_suite.py``; inert unless its variables are set.

``tools/upstream_suite.py`` puts this directory first on ``PYTHONPATH`` of each
pytest child, so Python imports this module at the start of that process and of
every process it spawns (``FSDPTest`` ranks, ``MultiProcContinuousTest``
workers, ``multiprocessing`` spawn children), before any test module runs.

- ``TORCH_FSDP_EXT_SUITE_MODE``: ``pristine`` (torch as installed), ``grouped``
  (``torch.distributed.fsdp._fully_shard`` and each submodule replaced by
  ``torch_fsdp_ext._fully_shard``) or ``per-param`` (the same, with
  ``fully_shard`` defaulting to ``group_collectives=False``).
- ``TORCH_FSDP_EXT_SUITE_HARNESS``: ``gloo`` lifts the accelerator-count checks
  of upstream's ``FSDPTest``/``FSDPTestContinuous`` and ``skip_if_lt_x_gpu`` so
  their tests run on CPU with gloo, as if ``TORCH_FSDP_EXT_SUITE_GLOO_DEVICES``
  devices were present; ``threaded`` changes nothing.
"""

import os

MODE_ENV = "TORCH_FSDP_EXT_SUITE_MODE"
HARNESS_ENV = "TORCH_FSDP_EXT_SUITE_HARNESS"
DEVICES_ENV = "TORCH_FSDP_EXT_SUITE_GLOO_DEVICES"
UPSTREAM = "torch.distributed.fsdp._fully_shard"
MODES = ("pristine", "grouped", "per-param")
HARNESSES = ("threaded", "gloo")


def _substitute(per_param: bool) -> None:
    """Make every import path of upstream FSDP2 resolve to the generated copy.

    ``torch_fsdp_ext`` is imported first, while the upstream names are still
    upstream's: its ``_torch_compat`` hooks into upstream's own modules.
    """
    import importlib
    import pkgutil
    import sys
    import types

    import torch.distributed.fsdp as fsdp

    import torch_fsdp_ext._fully_shard as ext

    upstream_modules = {
        name: mod
        for name, mod in list(sys.modules.items())
        if name == UPSTREAM or name.startswith(UPSTREAM + ".")
    }
    ext_modules = {"": ext}
    for info in pkgutil.iter_modules(ext.__path__):
        ext_modules[info.name] = importlib.import_module(f"{ext.__name__}.{info.name}")
    missing = sorted(
        info.name
        for info in pkgutil.iter_modules(upstream_modules[UPSTREAM].__path__)
        if info.name not in ext_modules
    )
    if missing:
        raise RuntimeError(f"upstream {UPSTREAM} modules absent from the generated copy: {missing}")

    # Each upstream object that an ext module has under the same name maps to it
    replacement: dict[int, object] = {}
    for name, up_mod in upstream_modules.items():
        ext_mod = ext_modules[name[len(UPSTREAM) + 1 :]]
        for attr, value in vars(up_mod).items():
            # Classes, functions and modules only: ids of small constants are shared
            if (
                isinstance(value, type | types.FunctionType | types.ModuleType)
                and not attr.startswith("__")
                and hasattr(ext_mod, attr)
            ):
                replacement.setdefault(id(value), getattr(ext_mod, attr))
    for short, ext_mod in ext_modules.items():
        sys.modules[UPSTREAM + (f".{short}" if short else "")] = ext_mod
    fsdp._fully_shard = ext
    for attr, value in list(vars(fsdp).items()):
        if id(value) in replacement and not attr.startswith("__"):
            setattr(fsdp, attr, replacement[id(value)])

    if per_param:
        # ``contract`` wraps the function; its keyword default is what a call
        # without ``group_collectives`` gets, whoever imported ``fully_shard``
        inner = ext.fully_shard.__wrapped__
        if "group_collectives" not in (inner.__kwdefaults__ or {}):
            raise RuntimeError("torch_fsdp_ext fully_shard has no group_collectives keyword")
        inner.__kwdefaults__["group_collectives"] = False


def _lift_accelerator_checks(devices: int) -> None:
    """Run upstream's multi-process FSDP tests on CPU with gloo.

    On a machine without accelerators upstream's harness already picks CPU and
    gloo (``common_fsdp.DEVICE_TYPE``/``DISTRIBUTED_BACKEND``); what skips the
    tests are accelerator counts: ``FSDPTest._run`` and
    ``FSDPTestContinuous._init_pg`` exit with the multi-device skip code when
    ``torch.accelerator.device_count() < world_size``; ``skip_if_lt_x_gpu(x)``
    skips unless ``x`` accelerators (or ``allow_cpu=True``); and test classes
    size their world as ``min(k, torch.get_device_module("cpu").device_count())``,
    which is 1. Only these are changed.
    """
    import functools
    import inspect
    import sys

    import torch
    import torch.testing._internal.common_distributed as common_distributed

    if torch.accelerator.is_available():
        raise RuntimeError("the gloo harness is for machines without an accelerator")
    torch.cpu.device_count = lambda: devices

    upstream_skip = common_distributed.skip_if_lt_x_gpu

    def skip_if_lt_x_gpu(x, *, allow_cpu=False):
        def decorator(func):
            if x > devices:
                return upstream_skip(x, allow_cpu=allow_cpu)(func)

            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                return func(*args, **kwargs)

            wrapper._min_gpus_required = x
            return wrapper

        return decorator

    common_distributed.skip_if_lt_x_gpu = skip_if_lt_x_gpu

    import torch.testing._internal.common_fsdp as common_fsdp

    # FSDPTest._run is FSDPTestMixin._run except that it skips on CPU too: drop
    # it so the mixin's runs, after checking that this is still the only change
    test_run = common_fsdp.FSDPTest.__dict__.get("_run")
    mixin_run = common_fsdp.FSDPTestMixin.__dict__.get("_run")
    if test_run is not None:
        cpu_guard = 'DEVICE_TYPE != "cpu" and torch.accelerator.device_count()'
        lifted = inspect.getsource(test_run.__func__).replace(
            "torch.accelerator.device_count()", cpu_guard
        )
        if mixin_run is None or lifted != inspect.getsource(mixin_run.__func__):
            raise RuntimeError(
                "FSDPTest._run differs from FSDPTestMixin._run by more than the "
                "accelerator-count check; update tools/_upstream_suite_site"
            )
        del common_fsdp.FSDPTest._run

    continuous = common_fsdp.FSDPTestContinuous
    source = inspect.getsource(continuous.__dict__["_init_pg"].__func__)
    if "torch.accelerator.device_count() < world_size" not in source:
        raise RuntimeError("FSDPTestContinuous._init_pg changed; update tools/_upstream_suite_site")

    def _init_pg(cls, rank, world_size, rdvz_file):
        # FSDPTestContinuous._init_pg less its count check (and set_device, a
        # no-op without accelerators)
        os.environ["TORCH_NCCL_DESYNC_DEBUG"] = "0"
        super(continuous, cls)._init_pg(rank, world_size, rdvz_file)

    continuous._init_pg = classmethod(_init_pg)
    sys.modules[__name__].lifted = True


def _install() -> None:
    mode = os.environ.get(MODE_ENV, "")
    harness = os.environ.get(HARNESS_ENV, "")
    if not mode and not harness:
        return
    if mode not in MODES or harness not in HARNESSES:
        raise RuntimeError(
            f"{MODE_ENV}={mode!r} must be one of {MODES}, {HARNESS_ENV}={harness!r} one of {HARNESSES}"
        )
    if mode != "pristine":
        _substitute(per_param=mode == "per-param")
    if harness == "gloo":
        _lift_accelerator_checks(int(os.environ.get(DEVICES_ENV, "8")))


lifted = False
try:
    _install()
except BaseException:
    # site.py would print this and go on with torch unchanged: a run that
    # silently tests upstream instead. Stop the process instead.
    import sys
    import traceback

    traceback.print_exc()
    print("tools/_upstream_suite_site/sitecustomize.py: setup failed", file=sys.stderr)
    sys.stderr.flush()
    os._exit(3)
