"""Makes vLLM 0.33.0's pure-Python modules importable without installing vLLM.

The tests compare kvrelay's classes with vLLM's own, run from a vLLM source tree: ``VLLM_SRC``
(default ``~/.cache/kvrelay/vllm-tests/vllm-0.33.0``, made by
``shared/tools/vllm-tests/setup.sh``). Without that tree the session stops with a usage error
that says so: the tests never skip silently.

How: vLLM's packages are made from their folders without running their ``__init__.py`` (which
import torch, CUDA probes and the engine); the modules the tests use run for real; the heavy
or absent imports they make are stubs (``_STUBS``, and numpy, prometheus_client or
typing_extensions only if they are not installed). Installed once, when pytest loads this file,
before any test module imports vLLM.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types

import pytest

VLLM_SRC = os.environ.get(
    "VLLM_SRC",
    os.path.join(os.path.expanduser("~"), ".cache", "kvrelay", "vllm-tests", "vllm-0.33.0"),
)

# Modules replaced by stubs whatever is installed: heavy, or configuration the tests never use.
_STUBS = (
    "torch",
    "vllm.config",
    "vllm.platforms",
    "vllm.envs",
    "vllm.v1.kv_hints",
    "vllm.distributed.kv_transfer.kv_connector.factory",
    # What vllm.v1.outputs and kv_connector/utils.py import beside the classes the aggregator
    # tests use (KVConnectorOutput, ModelRunnerOutput, KVOutputAggregator).
    "vllm.compilation",
    "vllm.model_executor",
    "vllm.v1.attention",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.core.sched",
)


class _Anything:
    """A stand-in for any attribute of a stub module: callable, indexable, a base class."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        return _Anything(self._name + "()")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self._name}.{name}")

    def __getitem__(self, key):
        return _Anything(self._name + "[]")

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (object,)

    def __iter__(self):
        return iter(())


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _NumpyArray(list):
    """numpy is not installed: ``np.array(ids, dtype=np.int32)`` only holds the ids."""

    ndim = 1

    def tolist(self):
        return list(self)


def _fill_stub(module: types.ModuleType) -> None:
    """What the stubs must really provide."""
    name = module.__name__
    if name == "numpy":
        module.array = lambda values, dtype=None: _NumpyArray(int(v) for v in values)
        module.int32, module.int64, module.ndarray = "int32", "int64", _NumpyArray
        # Read by pytest.approx whenever a module named numpy is loaded.
        module.bool_ = type("bool_", (), {})
    elif name == "typing_extensions":
        module.override = lambda f: f
    elif name == "vllm.logger":
        module.init_logger = logging.getLogger
    elif name == "vllm.utils.math_utils":
        module.cdiv = lambda a, b: -(a // -b)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class _VllmFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stubs (``stubs``), and vLLM's packages from ``src`` without their ``__init__.py``."""

    def __init__(self, src: str, stubs: tuple[str, ...]):
        self.src = src
        self.stubs = stubs

    def find_spec(self, name, path, target=None):
        if any(name == s or name.startswith(s + ".") for s in self.stubs):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name == "vllm" or name.startswith("vllm."):
            folder = os.path.join(self.src, *name.split("."))
            if os.path.isdir(folder):
                spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
                spec.submodule_search_locations = [folder]
                return spec
        return None

    def create_module(self, spec):
        if spec.submodule_search_locations:
            module = types.ModuleType(spec.name)
            module.__path__ = list(spec.submodule_search_locations)
            return module
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        _fill_stub(module)


def install_vllm_from_source(src: str = VLLM_SRC) -> None:
    """Makes ``import vllm.v1.kv_offload...`` load from ``src`` (once)."""
    if any(isinstance(f, _VllmFinder) for f in sys.meta_path):
        return
    marker = os.path.join(src, "vllm", "v1", "kv_offload", "cpu", "manager.py")
    if not os.path.isfile(marker):
        raise pytest.UsageError(
            f"vLLM 0.33.0's source tree is needed at VLLM_SRC={src} (no {marker}): "
            "run shared/tools/vllm-tests/setup.sh, or set VLLM_SRC to an unpacked vllm-0.33.0"
        )
    stubs = list(_STUBS) + ["vllm.logger", "vllm.utils"]
    stubs += [m for m in ("numpy", "prometheus_client", "typing_extensions") if not _installed(m)]
    sys.meta_path.insert(0, _VllmFinder(src, tuple(stubs)))


install_vllm_from_source()
