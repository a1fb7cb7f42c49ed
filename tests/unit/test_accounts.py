"""Account cache scopes -> the cache_salt ingress gives a request (shared/accounts.py)."""

from __future__ import annotations

import pytest

from shared.accounts import Account, check_request_salt, check_scope
from shared.blocks import RequestBlocks


def test_each_scope_names_its_namespace() -> None:
    assert Account("alpha").cache_salt() == "account:alpha"
    assert Account("alpha").cache_salt("u1") == "account:alpha/request:u1"
    assert Account("gamma", "group:acme").cache_salt() == "group:acme"
    assert (
        Account("delta", "group:acme").cache_salt() == Account("gamma", "group:acme").cache_salt()
    )
    assert Account("dev", "shared").cache_salt() == ""
    assert Account("dev", "shared").cache_salt("u1") == "/request:u1"


def test_no_request_salt_reaches_another_accounts_namespace() -> None:
    """Whatever a request sends, its salt starts with its own account's namespace."""
    for salt in ("", "x", "account:beta", "../beta", "request:u1"):
        assert Account("alpha").cache_salt(salt).startswith("account:alpha")
        assert Account("alpha").cache_salt(salt) != Account("beta").cache_salt()


def test_salted_hashes_differ_for_the_same_tokens() -> None:
    tokens = list(range(64))
    hashes = {
        salt: RequestBlocks.hash_prompt(
            tokens, model="tiny-coder", block_size_tokens=16, cache_salt=salt
        ).hashes
        for salt in ("", "account:alpha", "account:beta", "group:acme")
    }
    assert len({tuple(h) for h in hashes.values()}) == len(hashes)


@pytest.mark.parametrize("scope", ["", "group:", "group:a b", "Account", "group:é", "sharedx"])
def test_a_bad_scope_is_refused(scope: str) -> None:
    with pytest.raises(ValueError, match="scope|group"):
        check_scope(scope)


@pytest.mark.parametrize("salt", ["", "a b", "é", "x" * 129, "tab\there"])
def test_a_bad_request_salt_is_refused(salt: str) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        check_request_salt(salt)
