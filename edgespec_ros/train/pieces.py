"""A file in pieces of at most N bytes, with a manifest, and joined back verified.

What a remote GPU machine gives back is limited per file (docs/models.md: "Carrying a run across
GPU machines"), and a training checkpoint with its optimizer's state is larger. ``split_file``
writes ``<name>.<tag>.000``, ``.001``, ... and ``<name>.manifest.json`` (each piece's name, size
and sha256, the whole file's size and sha256, and the caller's ``meta``); ``join_pieces`` checks
every piece against the manifest and writes the whole file back, or raises ``PiecesError`` saying
which piece is missing or damaged. ``tag`` is the start of the whole file's sha256: a new split
writes its pieces beside the old ones, then the manifest (atomically), then removes the old
pieces, so a stop at any point leaves one complete, consistent set.

    python -m edgespec_ros.train.pieces split FILE DIR [--max-mib 15]
    python -m edgespec_ros.train.pieces verify DIR/NAME.manifest.json [--copy-to DIR2]
    python -m edgespec_ros.train.pieces join DIR/NAME.manifest.json OUT_FILE
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile

MANIFEST_SUFFIX = ".manifest.json"
_CHUNK = 1 << 20


class PiecesError(RuntimeError):
    """Pieces that cannot be joined: a missing manifest or piece, a wrong size or hash."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def manifest_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + MANIFEST_SUFFIX)


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a copy made as another user from reading it
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def split_file(path: str, directory: str, max_bytes: int, meta: dict | None = None) -> str:
    """Write ``path`` into ``directory`` as pieces of at most ``max_bytes`` and a manifest;
    returns the manifest's path. Pieces of an earlier split of the same name are removed once the
    new manifest is in place."""
    if max_bytes < 1:
        raise ValueError(f"split_file: max_bytes must be positive, not {max_bytes}")
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(path)
    whole = sha256_file(path)
    tag = whole[:12]
    pieces, size = [], 0
    with open(path, "rb") as f:
        while True:
            data = f.read(max_bytes)
            if not data and pieces:
                break
            piece = f"{name}.{tag}.{len(pieces):03d}"
            _write_atomic(os.path.join(directory, piece), data)
            pieces.append({"name": piece, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            size += len(data)
            if len(data) < max_bytes:
                break
    manifest = {"name": name, "size": size, "sha256": whole, "max_bytes": max_bytes, "pieces": pieces,
                "meta": meta or {}}
    target = manifest_path(directory, name)
    _write_atomic(target, json.dumps(manifest, indent=1).encode())
    _remove_other_pieces(directory, name, {p["name"] for p in pieces})
    return target


def _remove_other_pieces(directory: str, name: str, keep: set) -> None:
    earlier = re.compile(re.escape(name) + r"\.[0-9a-f]{12}\.[0-9]{3}")
    for other in os.listdir(directory):  # an earlier split's pieces
        if earlier.fullmatch(other) and other not in keep:
            os.unlink(os.path.join(directory, other))


def read_manifest(path: str) -> dict:
    """The manifest at ``path``; PiecesError when it is missing or not one."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise PiecesError(f"{path}: no manifest there") from None
    except (OSError, ValueError) as exc:
        raise PiecesError(f"{path}: not a readable manifest ({type(exc).__name__}: {exc})") from None
    if not isinstance(manifest, dict) or not {"name", "size", "sha256", "pieces"} <= set(manifest):
        raise PiecesError(f"{path}: not a pieces manifest (needs name, size, sha256, pieces)")
    return manifest


def verify_pieces(manifest_file: str) -> dict:
    """Check every piece the manifest at ``manifest_file`` names (present, its size, its sha256)
    and the whole; returns the manifest, or raises PiecesError naming what is wrong."""
    manifest = read_manifest(manifest_file)
    directory = os.path.dirname(manifest_file)
    whole, size, problems = hashlib.sha256(), 0, []
    for piece in manifest["pieces"]:
        path = os.path.join(directory, piece["name"])
        if not os.path.isfile(path):
            problems.append(f"{piece['name']} is missing")
            continue
        with open(path, "rb") as f:
            data = f.read()
        if len(data) != piece["size"]:
            problems.append(f"{piece['name']} has {len(data)} bytes, not {piece['size']}")
        elif hashlib.sha256(data).hexdigest() != piece["sha256"]:
            problems.append(f"{piece['name']} is damaged (sha256 differs)")
        whole.update(data)
        size += len(data)
    if problems:
        raise PiecesError(f"{manifest_file}: {'; '.join(problems)} (of {len(manifest['pieces'])} pieces): "
                          "copy the pieces again")
    if size != manifest["size"] or whole.hexdigest() != manifest["sha256"]:
        raise PiecesError(f"{manifest_file}: the pieces join to a file that is not the one split "
                          "(size or sha256 differs): copy the pieces again")
    return manifest


def join_pieces(manifest_file: str, out_path: str) -> dict:
    """Verify the pieces (``verify_pieces``) and write the whole file to ``out_path`` atomically;
    returns the manifest. Nothing is written when a piece is missing or damaged."""
    manifest = verify_pieces(manifest_file)
    directory = os.path.dirname(manifest_file)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out_path)), prefix=os.path.basename(out_path) + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in manifest["pieces"]:
                with open(os.path.join(directory, piece["name"]), "rb") as g:
                    f.write(g.read())
        if sha256_file(tmp) != manifest["sha256"]:  # changed while being joined
            raise PiecesError(f"{manifest_file}: the joined file's sha256 differs: copy the pieces again")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return manifest


def copy_pieces(manifest_file: str, directory: str) -> str:
    """Verify the pieces (``verify_pieces``) and copy them and their manifest (last) into
    ``directory``, removing any other split's pieces there; returns the copied manifest's path."""
    import shutil
    manifest = verify_pieces(manifest_file)
    os.makedirs(directory, exist_ok=True)
    source = os.path.dirname(manifest_file)
    target = manifest_path(directory, manifest["name"])
    if os.path.abspath(target) == os.path.abspath(manifest_file):
        return target
    for piece in manifest["pieces"]:
        shutil.copyfile(os.path.join(source, piece["name"]), os.path.join(directory, piece["name"]))
    shutil.copyfile(manifest_file, target)
    _remove_other_pieces(directory, manifest["name"], {p["name"] for p in manifest["pieces"]})
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgespec_ros.train.pieces", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="FILE -> DIR/FILE.<tag>.NNN + DIR/FILE.manifest.json")
    s.add_argument("file")
    s.add_argument("directory")
    s.add_argument("--max-mib", type=float, default=15.0, help="largest piece in MiB (default 15)")
    v = sub.add_parser("verify", help="check the pieces a manifest names")
    v.add_argument("manifest")
    v.add_argument("--copy-to", default=None, help="then copy them and the manifest into this directory")
    j = sub.add_parser("join", help="verify and join the pieces a manifest names into OUT_FILE")
    j.add_argument("manifest")
    j.add_argument("out")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "split":
            path = split_file(args.file, args.directory, int(args.max_mib * 2**20))
            print(f"{args.file} -> {len(read_manifest(path)['pieces'])} pieces, {path}")
        elif args.cmd == "verify":
            m = verify_pieces(args.manifest)
            print(f"{args.manifest}: {len(m['pieces'])} pieces, {m['size']} bytes, ok")
            if args.copy_to:
                print(f"copied to {copy_pieces(args.manifest, args.copy_to)}")
        else:
            join_pieces(args.manifest, args.out)
            print(f"{args.manifest} -> {args.out}")
    except PiecesError as e:
        print(f"pieces: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
