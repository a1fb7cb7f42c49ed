from __future__ import annotations

import numpy as np
import pytest

from shared.schema import pack_block_hashes, pack_token_ids, unpack_block_hashes, unpack_token_ids
from shared.subjects import Subjects, discovery, is_inbox


def test_token_ids_round_trip_from_lists_and_arrays() -> None:
    ids = [0, 1, 2**32 - 1, 151_643]
    assert unpack_token_ids(pack_token_ids(ids)).tolist() == ids
    array = np.array(ids, dtype=np.int64)
    assert pack_token_ids(array) == pack_token_ids(ids)
    assert pack_token_ids([]) == b"" and unpack_token_ids(b"").size == 0
    assert pack_token_ids([1, 2]) == b"\x01\x00\x00\x00\x02\x00\x00\x00"  # little-endian u32


def test_block_hashes_use_the_full_64_bits() -> None:
    hashes = [0, 2**63, 2**64 - 1]
    assert unpack_block_hashes(pack_block_hashes(hashes)).tolist() == hashes


@pytest.mark.parametrize("bad", [[-1], [2**32], ["7"], [1.5]])
def test_bad_token_ids_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        pack_token_ids(bad)  # type: ignore[arg-type]


def test_truncated_packed_ids_are_rejected() -> None:
    with pytest.raises(ValueError, match="not a multiple of 4"):
        unpack_token_ids(b"\x01\x00\x00")


def test_subjects_under_a_root() -> None:
    subjects = Subjects("t1.kvf.v1")
    assert subjects.router_generate == "t1.kvf.v1.router.generate"
    assert subjects.instance(subjects.decode_run, "decode-3") == "t1.kvf.v1.decode.run.decode-3"
    assert subjects.load("kv-index", "kv-index-0") == "t1.kvf.v1.load.kv-index.kv-index-0"
    assert subjects.usage_stream == "KVF_USAGE_t1_kvf_v1"
    assert discovery("PING", "router", "router-0") == "$SRV.PING.router.router-0"
    for bad in ("a b", "x.*", "x.>", ""):
        with pytest.raises(ValueError):
            Subjects(bad)
    with pytest.raises(ValueError):
        subjects.instance(subjects.decode_run, "decode.3")


def test_only_a_reply_inbox_takes_a_stream() -> None:
    assert is_inbox("_INBOX.abc") and is_inbox("_INBOX.abc.7")
    for subject in ("", "_INBOX", "_INBOX.", "_INBOX.>", "_INBOX.a.*", "kvf.v1.usage.decode"):
        assert not is_inbox(subject), subject
    assert not is_inbox("_INBOXES.a") and not is_inbox("x._INBOX.a")
