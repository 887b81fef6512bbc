"""vLLM 0.33.0's own code for the KV-events judge, loaded from its sources without importing
the `vllm` package (which needs torch): the event classes of `vllm/distributed/kv_events.py`
(executed whole, with its few imports stubbed), and single functions cut out of their modules
with `ast` (`hash_block_tokens`, `maybe_convert_block_hash`, `sha256`, the test suite's
`MockSubscriber`). Nothing here re-implements vLLM: every function and class is vLLM's text.
"""

import ast
import hashlib
import logging
import os
import pathlib
import pickle
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, NewType


def src_root():
    """The unpacked vllm-0.33.0 tree: $VLLM_SRC, else the Python package CI's cache."""
    return pathlib.Path(
        os.environ.get("VLLM_SRC")
        or pathlib.Path.home() / ".cache/kvrelay/python-ci/vllm-0.33.0"
    )


def _cut(path, names, namespace):
    """Executes the top-level definitions `names` of `path` in `namespace`."""
    tree = ast.parse(path.read_text())
    wanted = [
        n
        for n in tree.body
        if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
        and _name(n) in names
    ]
    found = {_name(n) for n in wanted}
    if found != set(names):
        raise LookupError(f"{path}: missing {sorted(set(names) - found)}")
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _name(node):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    target = node.targets[0] if isinstance(node, ast.Assign) else node.target
    return getattr(target, "id", None)


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def load_kv_events(root):
    """vLLM's `vllm.distributed.kv_events` module, its own text executed."""
    _stub("vllm")
    _stub("vllm.config")
    _stub("vllm.config.kv_events", KVEventsConfig=object)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub(
        "vllm.utils.network_utils",
        get_ip=None,
        get_tcp_uri=None,
        is_valid_ipv6_address=None,
        split_zmq_path=None,
    )
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    path = root / "vllm/distributed/kv_events.py"
    mod = types.ModuleType("vllm.distributed.kv_events")
    sys.modules[mod.__name__] = mod
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    return mod


class Hashing:
    """vLLM's block hashing, its own functions: `sha256` (the default
    `prefix_caching_hash_algo`), `hash_block_tokens`, `maybe_convert_block_hash`, with
    `NONE_HASH` derived from `DEFAULT_NONE_HASH_SEED` as `init_none_hash` does without
    `PYTHONHASHSEED`."""

    def __init__(self, root):
        ns = {"hashlib": hashlib, "pickle": pickle, "Any": Any}
        _cut(root / "vllm/utils/hashing.py", ["sha256"], ns)
        self.sha256 = ns["sha256"]
        utils = root / "vllm/v1/core/kv_cache_utils.py"
        envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
        ns = {
            "Any": Any,
            "Callable": Callable,
            "Sequence": Sequence,
            "BlockHash": NewType("BlockHash", bytes),
            "ExternalBlockHash": bytes | int,
            "envs": envs,
        }
        _cut(
            utils,
            ["DEFAULT_NONE_HASH_SEED", "hash_block_tokens", "maybe_convert_block_hash"],
            ns,
        )
        ns["NONE_HASH"] = ns["BlockHash"](self.sha256(ns["DEFAULT_NONE_HASH_SEED"]))
        self._ns = ns
        self.hash_block_tokens = ns["hash_block_tokens"]
        self.external = ns["maybe_convert_block_hash"]


def mock_subscriber(root, zmq, msgspec):
    """The test suite's `MockSubscriber` (tests/distributed/conftest.py)."""
    ns = {"zmq": zmq, "msgspec": msgspec, "SampleBatch": None}
    _cut(root / "tests/distributed/conftest.py", ["MockSubscriber"], ns)
    return ns["MockSubscriber"]
