"""Virtual environments for other stacks (vLLM, Dynamo's indexer), built on demand and
reused: their pins differ from ours, so each lives apart.

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


class VenvUnavailable(RuntimeError):
    """An environment could not be built; the message says why (and where the log is)."""


def venvs_dir() -> Path:
    return Path(os.environ.get("KVF_PEERS_DIR", Path.home() / ".cache" / "kvfabric" / "peers"))


def ensure_venv(
    name: str,
    requirements: Sequence[str],
    *,
    remove_after: Sequence[str] = (),
    add_ons: Sequence[str] = (),
    python: str = sys.executable,
) -> Path:
    """The python executable of venv `name` with `requirements` installed (built if missing
    or built for other requirements). `remove_after`: packages to uninstall once installed
    (a peer's optional dependencies that fail to import beside the CPU torch). `add_ons`:
    packages installed on top, in a step of their own, so that changing them does not
    rebuild the venv."""
    root = venvs_dir() / name
    exe = root / "bin" / "python"
    wanted = _fingerprint(requirements, remove_after)
    stamp = root / ".kvfabric-requirements"
    if not (exe.exists() and stamp.exists() and stamp.read_text() == wanted):
        _build(root, exe, requirements, remove_after, python)
        stamp.write_text(wanted)
    add_ons_stamp = root / ".kvfabric-add-ons"
    wanted_add_ons = _fingerprint(add_ons, ())
    if add_ons and not (add_ons_stamp.exists() and add_ons_stamp.read_text() == wanted_add_ons):
        _run([str(exe), "-m", "pip", "install", *add_ons], log=root / "install.log",
             what=f"installing {' '.join(add_ons)} into {root}")  # fmt: skip
        add_ons_stamp.write_text(wanted_add_ons)
    return exe


def _build(
    root: Path, exe: Path, requirements: Sequence[str], remove_after: Sequence[str], python: str
) -> None:
    log = root / "install.log"
    _say(f"building the {root.name} environment in {root} (pip: {' '.join(requirements)}); "
         f"log: {log}")  # fmt: skip
    started = time.monotonic()
    root.parent.mkdir(parents=True, exist_ok=True)
    (root / ".kvfabric-add-ons").unlink(missing_ok=True)
    _run([python, "-m", "venv", "--clear", str(root)], log=None, what=f"creating {root}")
    _run([str(exe), "-m", "pip", "install", "--upgrade", "pip"], log=log, what="upgrading pip")
    _run([str(exe), "-m", "pip", "install", *requirements], log=log,
         what=f"installing {' '.join(requirements)}")  # fmt: skip
    if remove_after:
        _run([str(exe), "-m", "pip", "uninstall", "-y", *remove_after], log=log,
             what=f"removing {' '.join(remove_after)}")  # fmt: skip
    _say(f"{root.name} environment ready in {time.monotonic() - started:.0f} s")


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
        raise VenvUnavailable(f"{what} failed (exit {done.returncode}):\n{output[-2000:]}")


def _say(text: str) -> None:
    print(f"[peers] {text}", file=sys.stderr, flush=True)
