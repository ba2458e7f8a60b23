"""requirements-gpu.lock, the GPU profile's lock, from a resolver run that needs no GPU.

    python tests/gpu/gpu_lock.py write    # resolve `.[sglang]` with this Python, write the lock
    python tests/gpu/gpu_lock.py check    # resolve again with the lock as constraints

`pip install --dry-run --ignore-installed --report` resolves without installing: it reads
each wheel's metadata (CUDA wheels included) for this interpreter on this platform, so run
it on Linux x86-64. Write under CPython 3.11 and check under 3.11 and 3.12: resolved on
3.12 alone, a few packages take releases that dropped 3.11, while 3.11's releases all have
3.12 wheels (docs/deployments.md, "The GPU profile").
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements-gpu.lock"
SHOWN = ("sglang", "torch", "transformers", "tokenizers")
HEADER = """\
# The GPU profile: Sluice with its `sglang` extra, Linux x86-64, CPython 3.11 or 3.12.
#   pip install -c requirements-gpu.lock -e ".[sglang]"
# sglang 0.5.23 pins torch 2.14.1 (a CUDA build) and transformers 5.19.0, so this profile
# has its own lock; requirements.lock (CPU torch 2.13.0, transformers 5.23.0) stays the
# laptop's and CI's. Written from a resolver run over `.[sglang]`; how to write it anew:
# docs/deployments.md, "The GPU profile".
"""


def pip_report(*args: str) -> list[dict]:
    """The `install` list of `pip install --dry-run --ignore-installed --report` over `args`,
    run from the repository's root (requirements.lock's tool uses it too)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        command += ["--quiet", "--report", str(report), *args]
        print("$", " ".join(command[2:]), flush=True)
        subprocess.run(command, cwd=ROOT, check=True)
        return list(json.loads(report.read_text())["install"])


def resolve(*constraints: str) -> dict[str, str]:
    """name -> version of everything `.[sglang]` installs into an empty environment."""
    installed = pip_report(*constraints, "-e", ".[sglang]")
    return {
        item["metadata"]["name"]: item["metadata"]["version"]
        for item in installed
        if item["metadata"]["name"] != "sluice-rl"
    }


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """A lock's pins, as written (names not normalized); comments are skipped."""
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            if not sep:
                raise SystemExit(f"{path.name}: '{raw}' is not a name==version pin")
            pins[name.strip()] = version.strip()
    return pins


def write_lock(pins: dict[str, str], path: Path = LOCK, header: str = HEADER) -> None:
    """`header`, then one `name==version` line a pin, sorted by name."""
    lines = sorted((f"{name}=={version}" for name, version in pins.items()), key=str.lower)
    path.write_text(header + "\n".join(lines) + "\n")


def summary(pins: dict[str, str]) -> str:
    shown = " ".join(f"{name}=={pins[name]}" for name in SHOWN)
    python = ".".join(map(str, sys.version_info[:3]))
    return f"CPython {python}: {len(pins)} packages besides sluice-rl; {shown}"


def main(argv: list[str]) -> int:
    if argv not in (["write"], ["check"]):
        print(__doc__)
        return 2
    if argv == ["write"]:
        pins = resolve()
        write_lock(pins)
        print(summary(pins))
        return 0
    pins, locked = resolve("-c", str(LOCK.relative_to(ROOT))), read_lock()
    print(summary(pins))
    differ = sorted(set(pins.items()) ^ set(locked.items()))
    print("the resolution is the lock" if not differ else f"differs from the lock: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
