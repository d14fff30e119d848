"""Hub ids ("Org/name") resolved to a local snapshot directory, as transformers does.

`huggingface_hub.snapshot_download` finds the snapshot in the local cache
(`HF_HUB_CACHE`, `HF_HOME`, or `~/.cache/huggingface/hub`) and downloads only what is
missing; with `HF_HUB_OFFLINE=1` it never touches the network and a snapshot that is not
in the cache is a clear error.
"""

from __future__ import annotations

import re
from pathlib import Path

# The hub's own rule for repo ids: an optional namespace and a name of letters, digits,
# '-', '_', '.'; huggingface_hub validates again, this only tells ids from missing paths.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")
# The files a specjax checkpoint needs: a HF directory's, or GGUF files.
_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer.json", "tokenizer_config.json", "generation_config.json", "*.gguf"]


def looks_like_repo_id(name: str) -> bool:
    """True for "Org/name" (one slash, no path syntax such as './' or '~')."""
    return name.count("/") == 1 and bool(_REPO_ID.match(name))


HEAD_PATTERNS = [*_PATTERNS, "heads.json", "pytorch_model.bin"]  # heads: EAGLE's are .bin


def resolve(repo_id: str, *, revision: str | None = None, patterns=None) -> Path:
    """The local snapshot directory of `repo_id` (downloaded unless `HF_HUB_OFFLINE`;
    only files matching `patterns`, default a model's)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=patterns or _PATTERNS))
    except LocalEntryNotFoundError as e:
        raise FileNotFoundError(
            f"hub id {repo_id!r} is not in the local Hugging Face cache and downloading is "
            f"off (HF_HUB_OFFLINE) or failed: {e}") from e
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a valid hub id: {e}") from e
    if not (path / "config.json").exists() and not any(path.glob("*.gguf")):
        raise FileNotFoundError(f"hub snapshot {path} of {repo_id!r} holds neither config.json "
                                "nor a .gguf file")
    return path
