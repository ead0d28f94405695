"""Test-wide settings: no test may reach the network. The Quickstart's build, packed once per session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Registers a Beam filesystem when imported; collecting its doctests would import (and register) it twice.
collect_ignore = ["url_filesystem.py"]


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python -m pipeline.pack`` with no arguments, run in an empty directory as the Quickstart's step 1:
    the directory (its ``shards/`` holds the embedded GSM8K test set's build) and the finished command.
    Tests read it and leave it as it is."""
    cwd = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return cwd, subprocess.run([sys.executable, "-m", "pipeline.pack", "--no-progress"], cwd=cwd, env=env,
                               capture_output=True, text=True, timeout=300)
