"""`steadydiff export --push-to-hub REPO_ID`: upload an exported folder to the Hugging Face Hub.

huggingface_hub is an optional extra (`pip install "steadydiff[hub]"`; diffusers depends on it too), imported
only here and only when asked, so every other command works without it.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from ..utils.errors import ExportError

EXTRA = 'pip install "steadydiff[hub]"'


def require_hub() -> ModuleType:
    """huggingface_hub, or a one-line ExportError naming the extra (checked before anything is exported)."""
    try:
        import huggingface_hub
    except ImportError as e:
        raise ExportError(f"--push-to-hub needs the huggingface_hub package, which is not installed: {EXTRA}") from e
    return huggingface_hub


def _failures(hub: ModuleType) -> tuple[type[BaseException], ...]:
    """What a failed upload raises that is the network's, the account's or the repo id's fault, not a bug: HTTP
    and transport errors (their base class differs between huggingface_hub versions), a missing token, a
    malformed repo id (HFValidationError is a ValueError)."""
    errors = getattr(hub, "errors", None)
    found = [getattr(errors, name, None) for name in ("HfHubHTTPError", "HTTPError")]
    return (OSError, ValueError, *(c for c in found if isinstance(c, type) and issubclass(c, BaseException)))


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False,
                commit_message: str = "steadydiff export") -> str:
    """Create the model repo `repo_id` if needed (private if asked) and upload `folder` into it; returns its URL.
    Authentication is huggingface_hub's own (`hf auth login`, or the HF_TOKEN variable)."""
    hub = require_hub()
    folder = Path(folder)
    api = hub.HfApi()
    try:
        # private=None keeps the Hub's default (public, or the organisation's setting) unless --private
        url = api.create_repo(repo_id, repo_type="model", private=True if private else None, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", commit_message=commit_message)
    except _failures(hub) as e:
        text = " ".join(str(e).split()) or type(e).__name__
        raise ExportError(f"uploading {folder} to {repo_id} failed ({text}); the export itself is complete: log in "
                          f"with `hf auth login` (or set HF_TOKEN) and run the upload again with `hf upload {repo_id} "
                          f"{folder}`") from e
    return str(url)
