"""Test-wide settings: no test may reach the network."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Registers a Beam filesystem when imported; collecting its doctests would import (and register) it twice.
collect_ignore = ["url_filesystem.py"]
