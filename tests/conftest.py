"""Shared test fixtures: one torch thread per process, and no child process left behind."""

from __future__ import annotations

import gc
import os

import psutil
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _kill_leftover_children():
    yield
    gc.collect()  # hivemind's MPFutures free torch shared memory through torch_shm_manager: let them go first
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if child.name() == "torch_shm_manager":
                continue
            child.kill()
        except psutil.Error:
            pass
