"""What a run's outputs depend on, resolved to things that cannot silently change: hub ids to commit hashes, local
files and folders to content fingerprints.

A run's config digest (which decides "skip, this config already has results" and "resume these generations") is
taken over these, so two runs that differ only in a model's weights or a dataset file's content never share state.

Local content is hashed in full (SHA-256) once; the hash is kept in ``$EVALKIT_CACHE/fingerprints.json`` (default
``~/.cache/evalkit``) keyed by path, size, modification and change times and inode, so a large checkpoint is read
once, not on every run. The change time (ctime) is set by the kernel on every write and cannot be set back, so a
rewrite that keeps the size and restores the modification time (``cp -p``, ``rsync -t``, an unpacked archive) is
still seen; a file changed in the last two seconds is always read again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

SKIPPED_DIRS = {".git", ".cache", "__pycache__", ".ipynb_checkpoints"}
RACY_SECONDS = 2.0
PROGRESS_BYTES = 256 << 20  # a progress bar when at least this much must be read


class MissingSource(FileNotFoundError):
    """A model or dataset named by a path that does not exist."""


def cache_dir() -> Path:
    return Path(os.environ.get("EVALKIT_CACHE") or Path.home() / ".cache" / "evalkit")


def looks_like_path(source: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything else with a slash, or starting like a path, is a path."""
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or os.sep + os.sep in source


class _HashCache:
    def __init__(self):
        self.path = cache_dir() / "fingerprints.json"
        try:
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.entries = {}
        self.changed = False

    @staticmethod
    def key(path: Path) -> str:
        stat = path.stat()
        return f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ctime_ns}|{stat.st_ino}"

    def file_hash(self, path: Path, progress=None) -> str:
        key = self.key(path)
        if key in self.entries:
            return self.entries[key]
        stat = path.stat()
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
                if progress is not None:
                    progress.update(len(block))
        # A file changed within the clock's resolution could change again with the same key ("racy git"): such a
        # file is hashed again next time rather than trusted from the cache.
        if time.time() - max(stat.st_mtime, stat.st_ctime) > RACY_SECONDS:
            self.entries[key] = digest.hexdigest()
            self.changed = True
        return digest.hexdigest()

    def save(self) -> None:
        if not self.changed:
            return
        try:  # a cache that cannot be written only costs a re-hash next time
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError:
            pass


def fingerprint(paths: list[str | os.PathLike], skip_suffixes: tuple[str, ...] = (),
                skip_names: tuple[str, ...] = ()) -> str:
    """``sha256:<hex>`` over the names and contents of ``paths`` (files, or folders walked recursively; in folders,
    files ending in ``skip_suffixes`` or named one of ``skip_names`` are left out)."""
    from tqdm import tqdm

    from evalkit.core.console import stream

    cache = _HashCache()
    named = []
    for root in sorted(Path(p).expanduser() for p in paths):
        if not root.exists():
            raise MissingSource(f"{root} does not exist")
        files = [root] if root.is_file() else sorted(
            f for f in root.rglob("*") if f.is_file() and not SKIPPED_DIRS & set(f.relative_to(root).parts[:-1])
            and not f.name.endswith(skip_suffixes) and f.name not in skip_names)
        named += [(file.name if file == root else str(file.relative_to(root)), file) for file in files]
    unread = sum(file.stat().st_size for _, file in named if cache.key(file) not in cache.entries)
    digest = hashlib.sha256()
    with tqdm(total=unread, unit="B", unit_scale=True, desc="  fingerprint", file=stream(),
              disable=unread < PROGRESS_BYTES) as bar:
        for name, file in named:
            digest.update(f"{name}\0{cache.file_hash(file, bar)}\n".encode())
    cache.save()
    return f"sha256:{digest.hexdigest()[:32]}"


def hub_revision(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str:
    """The commit hash ``revision`` (default: main) of a hub repo: from the local HF cache, else from the hub when
    online; ``unresolved:<revision>`` when neither can tell (loading will then fail with its own message)."""
    from huggingface_hub import constants

    wanted = revision or "main"
    if len(wanted) == 40 and all(c in "0123456789abcdef" for c in wanted):
        return wanted
    folder = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    ref = folder / "refs" / wanted
    if ref.is_file():
        return ref.read_text().strip()
    if not constants.HF_HUB_OFFLINE:
        try:
            from huggingface_hub import HfApi

            info = HfApi().repo_info(repo_id, repo_type=repo_type, revision=wanted)
            return str(info.sha)
        except Exception:  # noqa: BLE001 (offline, gated, unknown: the loader reports it in its own words)
            pass
    return f"unresolved:{wanted}"


def source_identity(source: str | list[str], repo_type: str = "model", revision: str | None = None) -> str:
    """``local:sha256:...`` for paths (which must exist), ``hub:<id>@<commit>`` for hub ids."""
    sources = [source] if isinstance(source, str) else list(source)
    remote = [s for s in sources if s.startswith("hf://")]
    if remote:  # raw files of one hub repo (LiveCodeBench's release files)
        repo = "/".join(remote[0].removeprefix("hf://").split("/")[1:3])
        return f"hub:{repo}@{hub_revision(repo, 'dataset', revision)}:{','.join(s.rsplit('/', 1)[-1] for s in remote)}"
    local = [Path(s).expanduser() for s in sources]
    if len(sources) == 1 and not local[0].exists() and not looks_like_path(sources[0]):
        return f"hub:{sources[0]}@{hub_revision(sources[0], repo_type, revision)}"
    missing = [str(p) for p in local if not p.exists()]
    if missing:
        raise MissingSource(f"{', '.join(missing)} does not exist")
    return f"local:{fingerprint(local)}"
