"""gateway.tenants: the tenant is the authenticated token's; the client's
cache_salt only narrows its namespace (isolated), or tenants share
(shared); without a tenant map the salt is the tenant, as before."""

from __future__ import annotations

import json

import pytest

from gateway.tenants import Tenants, load_tenant_tokens

MAP = {"alice-token-1": "alice", "bob-token-22": "bob"}


def test_isolated_namespaces_cannot_be_crossed_by_any_salt():
    t = Tenants(MAP)
    assert t.identify("Bearer alice-token-1", "") == ("alice", "tenant:5:alice:")
    assert t.identify("Bearer alice-token-1", "s") == ("alice", "tenant:5:alice:s")
    bob_salts = {t.identify("Bearer bob-token-22", s)[1] for s in ("", "tenant:5:alice:", "alice", ":alice:")}
    alice_salts = {t.identify("Bearer alice-token-1", s)[1] for s in ("", "x", "tenant:3:bob:")}
    assert bob_salts.isdisjoint(alice_salts)
    # a caller holding no tenant's token (the deployment token, or a wrong one) is tenant "", its own namespace
    assert t.identify("Bearer deployment", "tenant:5:alice:")[1] == "tenant:0::tenant:5:alice:"
    assert t.identify(None, "x") == ("", "tenant:0::x")
    assert t.owner("Bearer bob-token-22") == "tenant/bob" and t.owner("Bearer nope") is None


def test_shared_and_no_map():
    shared = Tenants(MAP, "shared")
    assert shared.identify("Bearer alice-token-1", "s") == ("alice", "s")
    assert shared.identify("Bearer bob-token-22", "s") == ("bob", "s")  # same namespace: they share
    none = Tenants()
    assert none.identify("Bearer whatever", "salt") == ("salt", "salt")  # the salt is the tenant
    with pytest.raises(ValueError):
        Tenants(MAP, "leaky")


@pytest.mark.parametrize("data", [[], {}, {"": "long-enough-token"}, {"a": "short"}, {"a": 12345678},
                                  {"a": "same-token-1", "b": "same-token-1"}, {"a\n": "long-enough-token"}])
def test_bad_tenant_files_are_refused(tmp_path, data):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError):
        load_tenant_tokens(path)


def test_tenant_file_and_the_gateway_flag(tmp_path):
    import argparse

    from gateway.cli import add_arguments, config_from_args

    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"alice": "alice-token-1", "bob": "bob-token-22"}))
    assert load_tenant_tokens(path) == MAP
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--model", "m", "--tenants", str(path), "--prefix-sharing", "shared"]))
    assert cfg.tenant_tokens == MAP and cfg.prefix_sharing == "shared"
    with pytest.raises(ValueError):
        load_tenant_tokens(tmp_path / "missing.json")
