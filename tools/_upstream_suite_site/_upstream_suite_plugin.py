"""pytest plugin loaded by ``tools/upstream_suite.py`` (``-p _upstream_suite_plugin``).

Threaded harness only: upstream's ``FSDPTest`` and ``FSDPTestContinuous`` exit
every rank with the multi-device skip code on a machine without accelerators
(``torch.accelerator.device_count() < world_size``), after spawning those
ranks. Mark their tests skipped at collection instead, as upstream's own
``test/conftest.py`` resolves GPU counts at collection, and spare the spawns.
"""

import os

import pytest

REASON = "multi-device: FSDPTest/FSDPTestContinuous need accelerators (skipped at collection)"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TORCH_FSDP_EXT_SUITE_HARNESS") != "threaded":
        return
    import torch

    if torch.accelerator.is_available():
        return
    from torch.testing._internal.common_fsdp import FSDPTest, FSDPTestContinuous

    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, FSDPTest | FSDPTestContinuous):
            item.add_marker(pytest.mark.skip(reason=REASON))
