"""Checksums of a checkpoint directory: written at save, verified before anything is loaded.

``step_N/manifest.sha256`` lists every file of the checkpoint directory (sub-directories included) as
``<sha256 hex>  <relative path>`` lines, the format of ``sha256sum`` (``cd step_N && sha256sum -c
manifest.sha256`` checks it by hand). :func:`verify_manifest` recomputes every checksum and fails naming
the first file that is missing, changed (a flipped byte anywhere) or not listed; a checkpoint without a
manifest is refused.

This detects corruption (a torn copy, a bad disk, a partial rsync), not an attacker: whoever can write
the run directory can rewrite the manifest too. megatron's / torch's checkpoint reader unpickles the
checkpoint's ``.metadata`` file, so a run directory must be trusted like code.
"""

from __future__ import annotations

import hashlib
import os

MANIFEST = "manifest.sha256"
_BLOCK = 1 << 20


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint's files do not match its manifest (message names the file)."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _files(ckpt_dir: str) -> list[str]:
    """Relative paths of every regular file under ``ckpt_dir`` except the manifest, sorted."""
    out = []
    for root, dirs, files in os.walk(ckpt_dir):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), ckpt_dir)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def write_manifest(ckpt_dir: str) -> str:
    """Hash every file of ``ckpt_dir`` and write ``ckpt_dir/manifest.sha256`` (atomic replace); returns its
    path. Call after every file of the checkpoint is complete, before the checkpoint is published."""
    lines = [f"{_sha256(os.path.join(ckpt_dir, rel))}  {rel}\n" for rel in _files(ckpt_dir)]
    path = os.path.join(ckpt_dir, MANIFEST)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)
    return path


def read_manifest(ckpt_dir: str) -> dict[str, str]:
    """``{relative path: sha256}`` of ``ckpt_dir/manifest.sha256``."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointIntegrityError(
            f"checkpoint {ckpt_dir} has no {MANIFEST}: it cannot be verified (written by an older version of the "
            "example, or copied without it); refusing to load it"
        )
    entries: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            digest, sep, rel = line.rstrip("\n").partition("  ")
            bad_digest = len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest)
            if not sep or not rel or bad_digest or rel.startswith("/") or ".." in rel.split("/"):
                raise CheckpointIntegrityError(f"{path}:{n}: not a '<sha256>  <relative path>' line: {line[:100]!r}")
            entries[rel] = digest
    return entries


def verify_manifest(ckpt_dir: str) -> None:
    """Raise :class:`CheckpointIntegrityError` naming the file unless every file of ``ckpt_dir`` is listed in
    its manifest with the same sha256 and every listed file exists."""
    expected = read_manifest(ckpt_dir)
    present = _files(ckpt_dir)
    for rel in present:
        if rel not in expected:
            raise CheckpointIntegrityError(
                f"checkpoint file {os.path.join(ckpt_dir, rel)} is not listed in {MANIFEST} (added after the save?)"
            )
    missing = sorted(set(expected) - set(present))
    if missing:
        raise CheckpointIntegrityError(f"checkpoint file {os.path.join(ckpt_dir, missing[0])} is missing")
    for rel in present:
        got = _sha256(os.path.join(ckpt_dir, rel))
        if got != expected[rel]:
            raise CheckpointIntegrityError(
                f"checkpoint file {os.path.join(ckpt_dir, rel)} is corrupt: sha256 {got[:16]}... differs from "
                f"{expected[rel][:16]}... recorded in {MANIFEST} at save time"
            )
