"""Reaching the Hugging Face Hub, or failing within seconds when it cannot be reached.

With ``HF_HUB_OFFLINE=1`` the Hugging Face libraries fail at once by themselves; without it
they retry for about 23 s on a machine with no network. ``check_reachable`` opens one TCP
connection with a short timeout first, so the command fails fast either way.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from pipeline.errors import HubUnreachableError, InputError

CONNECT_TIMEOUT_S = 3.0
_TRUE = {"1", "true", "yes", "on"}


def is_offline() -> bool:
    """Whether the Hugging Face libraries are told not to use the network."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _endpoint() -> tuple[str, int]:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)


def unreachable_reason() -> str | None:
    """Why the Hub cannot be reached over the network, or None when it may be."""
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the proxy decides; the libraries report their own error
    host, port = _endpoint()
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        return f"cannot connect to {host}:{port}: {err.strerror or err}"
    return None


def local_files_hint(what: str, repo: str) -> str:
    """How to use local files instead of a Hub dataset or tokenizer."""
    if what == "tokenizer":
        return (
            f"download it where there is network (hf download {repo} --local-dir DIR) "
            "and pass --tokenizer DIR (or DIR/tokenizer.json)"
        )
    return (
        f"download it where there is network (hf download --repo-type dataset {repo} --local-dir DIR) "
        "and pass --dataset DIR (its files of --split are read, as from the Hub), or a glob such as "
        "--dataset 'DIR/**/*.parquet'"
    )


def unreachable_error(what: str, repo: str, reason: str) -> HubUnreachableError:
    """The error for a Hub ``what`` ("dataset", "tokenizer") that cannot be loaded, with a hint to use local files."""
    return HubUnreachableError(
        f"{what} {repo} is on the Hugging Face Hub, which cannot be reached ({reason}); {local_files_hint(what, repo)}"
    )


def dataset_revision(repo: str) -> str:
    """The commit the main branch of Hub dataset ``repo`` points at now; raises HubUnreachableError offline."""
    if is_offline():
        raise unreachable_error("dataset", repo, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return HfApi().dataset_info(repo).sha
    except HfHubHTTPError as err:
        raise InputError(f"dataset {repo}: {str(err).splitlines()[0]}") from err


def dataset_url(repo: str, revision: str) -> str:
    """The fsspec URL of Hub dataset ``repo`` at ``revision`` (read through ``huggingface_hub.HfFileSystem``)."""
    return f"hf://datasets/{repo}@{revision}"


def require_reachable(what: str, repo: str) -> None:
    """Raise HubUnreachableError within seconds when the Hub cannot be reached over the network.

    In offline mode nothing is checked: the libraries then read their local cache or fail at once.
    """
    if is_offline():
        return
    reason = unreachable_reason()
    if reason is not None:
        raise unreachable_error(what, repo, reason)
