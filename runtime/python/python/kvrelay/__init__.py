"""kvrelay inside vLLM 0.33: drop-in classes whose logic is kvrelay's verified core.

- ``kvrelay.KVOutputAggregator`` for ``vllm.distributed.kv_transfer.kv_connector.utils.KVOutputAggregator``
- ``kvrelay.CPUOffloadingManager`` for ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``

The manager is a subclass of vLLM's ``OffloadingManager`` and returns vLLM's own types, so it is
imported (with vLLM) only when first used: ``import kvrelay`` alone does not import vLLM.
"""

from kvrelay._kvrelay import KVOutputAggregator

__all__ = ["KVOutputAggregator", "CPUOffloadingManager"]


def __getattr__(name: str):
    if name == "CPUOffloadingManager":
        from kvrelay.manager import CPUOffloadingManager

        return CPUOffloadingManager
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
