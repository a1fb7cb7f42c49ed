"""The connector inside vLLM's own venv, no cluster: its start-up check of both KV layouts
(float32's `vec`, bfloat16's `amx`) against vLLM's own cache-write kernels, and its shortening
of vLLM's idle spin. Marked `vllm` (builds vLLM's venv on first use); one python of that venv
runs both checks (~20 s here), beside the other tests: it starts no server."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from services.vllm_worker.vllm_env import SOURCE_ROOT, ensure_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm]


KERNEL_CHECK = """
import json, torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from services.vllm_worker.connector.layout import VllmBlockConverter, VllmLayoutError
from services.vllm_worker.connector.layout import check_with_kernel
out = {}
for dtype in (torch.float32, torch.bfloat16):
    isa = _get_attn_isa(dtype, 64, 64)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 3, 64, 128, dtype=dtype)
              for i in range(2)}
    def write(kc, vc, slots, k, v, isa=isa):
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    for layout in ("vec", "amx"):
        try:
            check_with_kernel(VllmBlockConverter.of(caches, 64, layout), write)
            out[f"{dtype} {isa} {layout}"] = "ok"
        except VllmLayoutError:
            out[f"{dtype} {isa} {layout}"] = "refused"
print(json.dumps({"kernel": out}))
"""


def test_each_layout_is_the_one_vllms_own_cache_write_kernel_fills(
    in_vllms_venv: dict[str, dict],
) -> None:
    """The connector's start-up check run against vLLM's kernels for both dtypes: the layout
    of the ISA vLLM picks reads back what the kernel wrote, the other layout is refused."""
    found = in_vllms_venv["kernel"]
    assert len(found) == 4, found
    for case, verdict in found.items():
        dtype, isa, layout = case.split()
        assert verdict == ("ok" if layout == isa else "refused"), found
    # This CPU (AVX-512 with AMX) runs bfloat16 through the tiled amx kernels.
    if "amx_tile" in Path("/proc/cpuinfo").read_text():
        assert "torch.bfloat16 amx amx" in found


SPIN_CHECK = """
import json, time, zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.network_utils import get_open_zmq_ipc_path
from services.vllm_worker.connector.spin import shorten_idle_spin
context = zmq.Context()
address = get_open_zmq_ipc_path()
writer = SpinCondition(is_reader=False, context=context, notify_address=address)
reader = SpinCondition(is_reader=True, context=context, notify_address=address)
polls = []
poll = reader.poller.poll
reader.poller.poll = lambda timeout=None: polls.append(timeout) or poll(timeout=0)
def idles_100ms_after_a_read():
    # spinning, wait() yields and returns; idle, it polls its socket
    reader.last_read = time.monotonic() - 0.1
    num_polls = len(polls)
    reader.wait(timeout_ms=300)
    return len(polls) > num_polls
before = idles_100ms_after_a_read()
changed = shorten_idle_spin(0.05)
print(json.dumps({"spin": {"idle_before": before, "changed": changed,
                           "idle_after": idles_100ms_after_a_read(),
                           "reader_s": reader.busy_loop_s, "writer_s": writer.busy_loop_s}}))
"""


@pytest.fixture(scope="module")
def in_vllms_venv() -> dict[str, dict]:
    """KERNEL_CHECK and SPIN_CHECK, run in one python of vLLM's venv (each start imports
    vLLM and torch: ~20 s here): what each printed, by its key."""
    python = ensure_vllm()
    env = os.environ | {"PYTHONPATH": str(SOURCE_ROOT)}
    script = "\n".join(check.strip() for check in (KERNEL_CHECK, SPIN_CHECK))
    done = subprocess.run(
        [str(python), "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found: dict[str, dict] = {}
    for line in done.stdout.splitlines():  # vLLM may print lines of its own
        if line.startswith(('{"kernel"', '{"spin"')):
            found |= json.loads(line)
    assert set(found) == {"kernel", "spin"}, done.stdout
    return found


def test_the_connector_shortens_vllms_idle_spin(in_vllms_venv: dict[str, dict]) -> None:
    """vLLM's shared-memory queue reader spins 1 s after each read (0.1 s after one it still
    spins); after `shorten_idle_spin(0.05)` it waits on its socket by then."""
    found = in_vllms_venv["spin"]
    assert found["changed"] == 1 and found["reader_s"] == 0.05, found
    assert found["writer_s"] == 0, found  # a writer never spins: left alone
    assert not found["idle_before"] and found["idle_after"], found
