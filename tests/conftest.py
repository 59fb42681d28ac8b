"""Shared test fixtures: one torch thread per process, no child process left behind, and no libp2p
discovery beyond loopback from any daemon the tests start."""

from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch

torch.set_num_threads(1)

# Every `fusionnode join` the tests spawn inherits these (besides LocalSwarm's explicit flags and the
# in-process helpers' LOCAL_ONLY): no UPnP/NAT-PMP toward a gateway, no AutoNAT, no relay service.
os.environ.update(
    {"FUSIONNODE_NAT_PORT_MAP": "off", "FUSIONNODE_AUTONAT": "off", "FUSIONNODE_RELAY_SERVICE": "off"}
)


@pytest.fixture(autouse=True, scope="session")
def _kill_leftover_children():
    yield
    gc.collect()  # hivemind's MPFutures free torch shared memory through torch_shm_manager: let them go first
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.name() == "torch_shm_manager":
                continue
            # multiprocessing's resource tracker (a check process or a bench child started it): killed,
            # it is relaunched at exit and prints a KeyError for every shared segment it never saw
            if any("resource_tracker" in part for part in child.cmdline()):
                continue
            child.kill()
        except psutil.Error:
            pass
