import os
import shutil
import sys
import tempfile
from pathlib import Path

import jax

# Tests compare float32 results against float64/PyTorch references: no reduced-precision matmuls.
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, str(Path(__file__).parent))

# The two xdist workers build the same tiny models and compile many of the same programs: one compilation cache
# for the run (made by the controller, fresh each run, removed at its end) lets a worker load what the other
# compiled.
CACHE_VAR = "JAX_OFFLOAD_TEST_COMPILE_CACHE"
if os.environ.get(CACHE_VAR):
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_VAR])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None) and CACHE_VAR not in os.environ:
        config.made_compile_cache = os.environ[CACHE_VAR] = tempfile.mkdtemp(prefix="jax_offload_tests_")


def pytest_unconfigure(config):
    made = getattr(config, "made_compile_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[CACHE_VAR]


def pytest_collection_modifyitems(items):
    """The virtual-device tensor-parallel check runs a subprocess for about two minutes: started first, it runs
    beside the other tests instead of after them (xdist hands tests out in this order)."""
    items.sort(key=lambda item: item.name != "test_tp_on_virtual_devices_equals_tp1")
