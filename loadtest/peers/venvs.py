"""Virtual environments for peers, built on demand and reused.

    python = ensure_venv("dynamo", ["ai-dynamo-runtime==1.6.1"])
    subprocess.run([str(python), "-m", "some.module"])

A venv lives under `$KVF_PEERS_DIR` (default ~/.cache/kvfabric/peers/<name>) and is rebuilt
when its requirements change (they are recorded in the venv). pip output goes to
<venv>/install.log; progress lines go to stderr, so a long install is never silent.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class PeerUnavailable(RuntimeError):
    """A peer's environment could not be built; the message says why (and where the log is)."""


def peers_dir() -> Path:
    return Path(os.environ.get("KVF_PEERS_DIR", Path.home() / ".cache" / "kvfabric" / "peers"))


def ensure_venv(
    name: str,
    requirements: Sequence[str],
    *,
    remove_after: Sequence[str] = (),
    python: str = sys.executable,
) -> Path:
    """The python executable of venv `name` with `requirements` installed (built if missing
    or built for other requirements). `remove_after`: packages to uninstall once installed
    (a peer's optional dependencies that fail to import beside the CPU torch)."""
    root = peers_dir() / name
    exe = root / "bin" / "python"
    wanted = _fingerprint(requirements, remove_after)
    stamp = root / ".kvfabric-requirements"
    if exe.exists() and stamp.exists() and stamp.read_text() == wanted:
        return exe
    log = root / "install.log"
    _say(f"building the {name} environment in {root} (pip: {' '.join(requirements)}); log: {log}")
    started = time.monotonic()
    root.parent.mkdir(parents=True, exist_ok=True)
    _run([python, "-m", "venv", "--clear", str(root)], log=None, what=f"creating {root}")
    _run([str(exe), "-m", "pip", "install", "--upgrade", "pip"], log=log, what="upgrading pip")
    _run([str(exe), "-m", "pip", "install", *requirements], log=log,
         what=f"installing {' '.join(requirements)}")  # fmt: skip
    if remove_after:
        _run([str(exe), "-m", "pip", "uninstall", "-y", *remove_after], log=log,
             what=f"removing {' '.join(remove_after)}")  # fmt: skip
    stamp.write_text(wanted)
    _say(f"{name} environment ready in {time.monotonic() - started:.0f} s")
    return exe


def _fingerprint(requirements: Sequence[str], remove_after: Sequence[str]) -> str:
    text = "\n".join([*requirements, "--remove--", *remove_after])
    return hashlib.sha256(text.encode()).hexdigest()


def _run(argv: list[str], *, log: Path | None, what: str) -> None:
    _say(what + " ...")
    if log is None:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        output = done.stdout + done.stderr
    else:
        with log.open("a") as out:
            out.write(f"$ {' '.join(argv)}\n")
            out.flush()
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
        output = log.read_text()[-2000:]
    if done.returncode != 0:
        raise PeerUnavailable(f"{what} failed (exit {done.returncode}):\n{output[-2000:]}")


def _say(text: str) -> None:
    print(f"[peers] {text}", file=sys.stderr, flush=True)
