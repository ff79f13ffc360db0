"""Models named by their Hugging Face Hub id (`--model Qwen/Qwen3-8B`), as
SGLang and vLLM take them: huggingface_hub finds the repository's snapshot
in its cache, or downloads it there, and pyserve reads that directory.

huggingface_hub's own settings apply: HF_TOKEN for gated and private
repositories, HF_HUB_OFFLINE=1 to use the cache alone, HF_ENDPOINT for a
mirror, HF_HOME or --download-dir for where the cache is.
"""

from __future__ import annotations

import re
from pathlib import Path

# pyserve reads safetensors weights and its JSON and text files: a
# repository's copies of the weights in other formats are not downloaded,
# but for EAGLE heads, which are often published as pytorch_model.bin.
OTHER_WEIGHT_FORMATS = ["*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.onnx_data", "*.gguf",
                        "*.tflite", "*.ot", "original/*", "onnx/*", "openvino/*", "coreml/*"]
TORCH_BINARIES = "*.bin"

# OWNER/NAME, or a bare NAME: the Hub's repository ids (letters, digits, - _ .).
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    """Whether `name`, which is not a local directory, can name a Hub
    repository (a path such as /models/x or ./x cannot)."""
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name and not name.endswith(".")


def check_revision(name: str | None, revision: str | None, flag: str, revision_flag: str) -> None:
    """ValueError for a revision given without a Hub id to apply it to."""
    if revision is None:
        return
    if name is None:
        raise ValueError(f"{revision_flag} picks a revision of a Hugging Face Hub id, and {flag} gives none")
    if Path(name).is_dir():
        raise ValueError(f"{revision_flag} {revision} picks a Hugging Face Hub revision, but {flag} {name} "
                         "is a local directory")


def local_model_dir(name: str, revision: str | None, download_dir: str | None, flag: str,
                    revision_flag: str = "--revision", torch_binaries: bool = False) -> str:
    """The directory `name` names: itself when it is a local directory,
    else the snapshot of the Hub repository `name` at `revision` (default:
    its main branch), with its `*.bin` files where `torch_binaries` (an
    EAGLE head's). ValueError, naming `flag`, when there is neither."""
    if Path(name).is_dir():
        return name
    if not is_hub_id(name):
        raise ValueError(f"{flag} {name} is not a directory")
    ignored = OTHER_WEIGHT_FORMATS if torch_binaries else [*OTHER_WEIGHT_FORMATS, TORCH_BINARIES]
    return _snapshot(name, revision, download_dir, flag, revision_flag, ignored)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | None, flag: str, revision_flag: str,
              ignored: list[str]) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, ignore_patterns=ignored)
    except HFValidationError as e:
        raise ValueError(f"{flag} {repo_id} is neither a local directory nor a Hub id: {e}") from None
    except GatedRepoError:
        raise ValueError(f"{flag} {repo_id}: the repository is gated; accept its terms on huggingface.co and set "
                         "HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{flag} {repo_id} is neither a local directory nor a repository on the Hugging Face Hub "
                         "(for a private one, set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ValueError(f"{revision_flag} {revision}: {repo_id} has no such branch, tag or commit") from None
    except LocalEntryNotFoundError:
        where = f" at revision {revision}" if revision else ""
        raise ValueError(f"{flag} {repo_id} is neither a local directory nor in the Hugging Face cache{where}, and "
                         "the Hub could not be reached (or HF_HUB_OFFLINE is set)") from None
    except OSError as e:  # the cache's disk, or the connection, failed mid-download
        raise ValueError(f"{flag} {repo_id}: downloading from the Hugging Face Hub failed: {e}") from None
