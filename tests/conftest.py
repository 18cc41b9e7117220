import sys
from pathlib import Path

import jax

# Tests compare float32 results against float64/PyTorch references: no reduced-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items):
    """The virtual-device tensor-parallel check runs a subprocess for about two minutes: started first, it runs
    beside the other tests instead of after them (xdist hands tests out in this order)."""
    items.sort(key=lambda item: item.name != "test_tp_on_virtual_devices_equals_tp1")
