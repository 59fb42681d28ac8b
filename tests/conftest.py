"""Shared test fixtures: one torch thread per process, and no child process left behind."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _kill_leftover_children():
    yield
    for child in psutil.Process(os.getpid()).children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass
