"""On the GPU machine: stage what a device call carried, and join the GGUF once complete.

tests/gpu/device_bundle.py lays the payload out in `.device/call1`, `call2`, ...; each
folder holds a `manifest.json` naming every file of every call with its size and
sha256. A call carries one folder, and /tmp outlives a call only while the machine
stays warm, so every call copies its folder's files into one state folder under /tmp
(checked against the manifest), says what is still missing and which call carries it,
and joins the GGUF's parts there once all are in. Standard library only: it runs before
anything is installed.

    python3 tests/gpu/device_stage.py --state /tmp/sluice-device [--repo .]

Exit status: 0 all there (GGUF joined and checked), 3 wheels there but GGUF parts
missing, 4 wheels missing, 2 a carried file is damaged or no manifest was carried.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sha256_of(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def stage(repo: Path, state: Path) -> int:
    """Copy what this call carried into `state`, check every file, join the GGUF; the
    exit status the module's docstring names."""
    manifests = sorted(repo.glob(".device/call*/manifest.json"))
    kept = state / "manifest.json"
    if not manifests and not kept.is_file():
        print("stage: MISSING: no .device/call*/manifest.json carried and none staged earlier")
        return 2
    manifest = json.loads((manifests[0] if manifests else kept).read_text())
    if kept.is_file() and json.loads(kept.read_text()).get("id") != manifest["id"]:
        print(f"stage: {state} holds another bundle: cleared")
        shutil.rmtree(state)
    state.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(manifest))
    carried_calls = sorted(int(p.parent.name.removeprefix("call")) for p in manifests)
    for item in manifest["files"]:
        source = repo / ".device" / f"call{item['call']}" / item["kind"] / item["name"]
        target = state / item["kind"] / item["name"]
        if not source.is_file() or (target.is_file() and target.stat().st_size == item["size"]):
            continue
        if sha256_of(source) != item["sha256"]:
            print(f"stage: DAMAGED: {source} (sha256 differs from the manifest)")
            return 2
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    missing: dict[str, list[str]] = {}
    for item in manifest["files"]:
        target = state / item["kind"] / item["name"]
        if not (target.is_file() and target.stat().st_size == item["size"]):
            missing.setdefault(item["kind"], []).append(f"{item['name']} (call {item['call']})")
    counts = {
        kind: sum(1 for f in manifest["files"] if f["kind"] == kind)
        for kind in ("wheels", "fallbacks", "gguf")
    }
    print(
        f"stage: bundle {manifest['id']}, this call carried call(s) {carried_calls or 'none'}; "
        + ", ".join(f"{k} {counts[k] - len(missing.get(k, []))}/{counts[k]}" for k in counts)
    )
    for kind, names in missing.items():
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        print(f"stage: MISSING {kind}: {shown}")
    if missing.get("wheels") or missing.get("fallbacks"):
        return 4
    if missing.get("gguf"):
        return 3
    joined = state / manifest["gguf"]["file"]
    if not (joined.is_file() and joined.stat().st_size == manifest["gguf"]["size"]):
        parts = [f for f in manifest["files"] if f["kind"] == "gguf"]
        with joined.open("wb") as out:
            for part in sorted(parts, key=lambda f: int(f["name"].removeprefix("gguf.part"))):
                with (state / "gguf" / part["name"]).open("rb") as piece:
                    shutil.copyfileobj(piece, out)
    if sha256_of(joined) != manifest["gguf"]["sha256"]:
        print(f"stage: DAMAGED: {joined} joined from its parts does not match its sha256")
        joined.unlink()
        return 2
    print(f"stage: {joined} joined and checked (sha256 {manifest['gguf']['sha256'][:12]}...)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", type=Path, default=Path("/tmp/sluice-device"))
    parser.add_argument("--repo", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    return stage(args.repo, args.state)


if __name__ == "__main__":
    sys.exit(main())
