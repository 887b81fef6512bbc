"""pytest plugin for the judge (``scripts/judge.sh connector``): vLLM's connector name
``OffloadingConnector`` loads ``kvrelay.vllm.KvrelayOffloadingConnector``, so that vLLM's own
tests that build the offloading connector through vLLM's ``KVConnectorFactory`` (by name, the
way a user configures it) run kvrelay's. Tests that import vLLM's class directly keep it.

Load with ``-p kvrelay_connector_subst`` and this folder on ``PYTHONPATH``; without
``KVRELAY_CONNECTOR=kvrelay`` it changes nothing (vLLM's own run of the same command).
"""

import os


def pytest_configure(config):
    if os.environ.get("KVRELAY_CONNECTOR") != "kvrelay":
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvrelay.vllm

    KVConnectorFactory._registry["OffloadingConnector"] = (
        lambda: kvrelay.vllm.KvrelayOffloadingConnector
    )
    print("[kvrelay_connector_subst] OffloadingConnector -> kvrelay.vllm.KvrelayOffloadingConnector")
