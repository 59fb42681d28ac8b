"""Shared test fixtures: one torch thread per process, no child process left behind, no libp2p
discovery beyond loopback from any daemon the tests start, and a module's swarm of `--debug` daemons."""

from __future__ import annotations

import asyncio
import gc
import os
import sys

import psutil
import pytest
import torch

from fusionnode.localswarm import LocalSwarm

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


@pytest.fixture(scope="module")
def debug_swarm(tmp_path_factory):
    """Four connected `fusionnode join --debug` daemons on loopback, one swarm per test module (the
    debug lies and ban resets of the verification and contribution e2e tests)."""
    s = LocalSwarm(tmp_path_factory.mktemp("swarm"), 4, log=sys.stderr)
    s.extra_args = ["--debug"]
    try:
        s.start()
        asyncio.run(s.wait_connected())
        yield s
    finally:
        s.stop()
