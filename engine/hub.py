"""Model references: a checkpoint directory, or a Hugging Face repo id (`org/name`, `org/name@revision`).

A repo id is fetched through `huggingface_hub` into its usual cache (HF_HOME / HF_HUB_CACHE), with
its progress bars and its tokens (HF_TOKEN, `hf auth login`). Only what the loader reads is
downloaded: config, tokenizer files and the safetensors shards (those the index names, when there
is one). HF_HUB_OFFLINE=1, or a Hub that cannot be reached, serves the cached snapshot; a file
missing from it is an error that names the repo and the file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

# Small files the loader and the tokenizer read when present (all but config.json are optional).
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
INFO_TIMEOUT_S = 15.0


class HubError(ValueError):
    """A model reference that cannot be turned into a local checkpoint; the message names it."""


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the local checkpoint directory
    name: str  # what clients see: the repo id, or the directory's name
    repo_id: str | None = None
    revision: str | None = None  # the commit the snapshot holds (repo ids only)


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_repo_ref(text: str) -> RepoRef | None:
    """'org/name' or 'org/name@revision' -> RepoRef; anything else -> None."""
    repo, _, revision = text.partition("@")
    if not REPO_ID.fullmatch(repo) or ".." in repo or (revision and not REVISION.fullmatch(revision)):
        return None
    if "@" in text and not revision:
        return None
    return RepoRef(repo, revision or None)


def resolve(text: str) -> ModelSource:
    """A directory is used as it is; a repo id is fetched (or found in the cache)."""
    path = Path(text).expanduser()
    if path.is_dir():
        return ModelSource(path=path, name=path.resolve().name)
    ref = parse_repo_ref(text)
    if path.exists():
        raise HubError(f"{text}: not a directory (pass the checkpoint directory)")
    if ref is None:
        raise HubError(f"{text}: no such directory (and not a Hugging Face repo id: org/name[@revision])")
    return fetch(ref)


def fetch(ref: RepoRef) -> ModelSource:
    from huggingface_hub import snapshot_download

    online, why_offline = _reach(ref)
    try:
        snapshot = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=list(SMALL_FILES),
                                          local_files_only=not online))
        index = snapshot / "model.safetensors.index.json"
        shards = sorted(set(_read_index(index, ref).values())) if index.is_file() else ["*.safetensors"]
        snapshot = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=shards,
                                          local_files_only=not online))
    except HubError:
        raise
    except Exception as e:
        raise _download_error(ref, e, why_offline) from None
    _check_complete(ref, snapshot, online, why_offline)
    return ModelSource(path=snapshot, name=ref.repo_id, repo_id=ref.repo_id, revision=snapshot.name)


def _reach(ref: RepoRef) -> tuple[bool, str]:
    """Ask the Hub about the repo. -> (reachable, why not). A repo or revision the Hub does not
    know is an error at once; a Hub out of reach means: use the cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return False, "HF_HUB_OFFLINE is set"
    try:
        HfApi().repo_info(ref.repo_id, revision=ref.revision, timeout=INFO_TIMEOUT_S)
    except RevisionNotFoundError:
        raise HubError(f"{ref.repo_id} has no revision {ref.revision!r} on the Hugging Face Hub") from None
    except GatedRepoError:
        raise HubError(f"{ref.repo_id} is gated: accept its terms on the Hub and log in "
                       "(`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{ref.repo_id}: no such model repo on the Hugging Face Hub, or it is private "
                       "(log in with `hf auth login`, or set HF_TOKEN)") from None
    except Exception as e:  # no network, DNS, proxy, timeout, Hub down: the cache may still serve
        return False, f"the Hub cannot be reached ({type(e).__name__}: {_first_line(e)})"
    return True, ""


def _download_error(ref: RepoRef, e: Exception, why_offline: str) -> HubError:
    from huggingface_hub import constants, errors

    # IncompleteSnapshotError is newer than huggingface_hub 0.24 (a partial snapshot, offline)
    not_cached = tuple(getattr(errors, n) for n in ("LocalEntryNotFoundError", "IncompleteSnapshotError")
                       if hasattr(errors, n))
    if isinstance(e, not_cached):
        return HubError(f"{ref} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why_offline}; "
                        "download it once with network access, or pass a checkpoint directory")
    return HubError(f"cannot download {ref}: {type(e).__name__}: {_first_line(e)}")


def _read_index(index: Path, ref: RepoRef) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise HubError(f"{ref}: model.safetensors.index.json is not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise HubError(f"{ref}: model.safetensors.index.json names no weight files")
    return {str(k): str(v) for k, v in weight_map.items()}


def _check_complete(ref: RepoRef, snapshot: Path, online: bool, why_offline: str) -> None:
    from huggingface_hub import constants

    needed = ["config.json", "tokenizer.json"]
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        needed += sorted(set(_read_index(index, ref).values()))
    elif not any(snapshot.glob("*.safetensors")):
        needed.append("*.safetensors")
    missing = [f for f in needed if not (snapshot / f).is_file()]
    if not missing:
        return
    if online:
        raise HubError(f"{ref} has no {missing[0]} (Spruce reads config.json, tokenizer.json and safetensors "
                       "weights)" + (f"; {len(missing)} files missing" if len(missing) > 1 else ""))
    raise HubError(f"{ref}: {missing[0]} is missing from the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                   f"and {why_offline}" + (f"; {len(missing)} files missing" if len(missing) > 1 else ""))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass(frozen=True)
class CachedModel:
    repo_id: str
    size_bytes: int
    revisions: tuple[str, ...]  # refs (main, tags) or short commit hashes
    model_type: str | None  # from the newest snapshot's config.json; None = no config
    path: Path  # the newest snapshot


def cached_models() -> list[CachedModel]:
    """The model repos in the local Hugging Face cache (what `spruce models` lists)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir()
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        refs = {ref for r in repo.revisions for ref in r.refs}
        names = tuple(sorted(refs or {r.commit_hash[:8] for r in repo.revisions}))
        out.append(CachedModel(repo.repo_id, repo.size_on_disk, names, _model_type(newest.snapshot_path),
                               newest.snapshot_path))
    return out


def _model_type(snapshot: Path) -> str | None:
    try:
        value = json.loads((snapshot / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None
