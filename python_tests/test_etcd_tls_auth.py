"""etcd as clusters run it: a real etcd 3.4 over TLS that demands client
certificates (``--client-cert-auth``), with RBAC on and one user per job whose
role grants only that job's key prefix (etcd_server.py). Transfers between two
processes pass with every key under the prefix; a client with a certificate of
another CA, without one, with a wrong password, or reaching for another job's
prefix fails creation with an error saying which, and no password is ever
printed."""

from __future__ import annotations

import pytest

import pjrt_ctypes as pc
import transfer_helpers as th
from etcd_server import Certificates, EtcdServer
from test_transfers_processes import Job

EC = pc.ErrorCode
PASSWORD_A = "pw-of-job-a-7f3c9"
PASSWORD_B = "pw-of-job-b-41d2e"
PREFIX_A = "jobs/a/"
PREFIX_B = "jobs/b/"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return Certificates(str(tmp_path_factory.mktemp("etcd-tls")))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory):
    """Another CA, which the etcd server does not trust."""
    return Certificates(str(tmp_path_factory.mktemp("etcd-stranger")), ca="stranger")


@pytest.fixture
def etcd(certs):
    s = EtcdServer(tls=certs)
    try:
        s.enable_auth({"job-a": (PASSWORD_A, PREFIX_A), "job-b": (PASSWORD_B, PREFIX_B)})
        yield s
    finally:
        s.close()


@pytest.fixture
def access_a(etcd, certs, tmp_path):
    """The create options of a process of job a: all it needs, nothing more."""
    cert, key = certs.issue("client-a", "job-a")
    password = tmp_path / "password-a"
    password.write_text(PASSWORD_A + "\n")
    return {
        "kv_store": etcd.url,
        "etcd_ca_file": certs.ca,
        "etcd_cert_file": cert,
        "etcd_key_file": key,
        "etcd_user": "job-a",
        "etcd_password_file": str(password),
        "etcd_key_prefix": PREFIX_A,
        "etcd_lease_ttl_s": 2,
        "kv_call_timeout_ms": 5000,
    }


def create_fails(api, options) -> pc.PjrtError:
    with pytest.raises(pc.PjrtError) as e:
        api.create_client(options).destroy()
    for secret in (PASSWORD_A, PASSWORD_B):
        assert secret not in e.value.message, e.value
    return e.value


def test_transfers_over_tls_with_rbac_keep_every_key_under_the_jobs_prefix(
    xh, api, server, etcd, access_a
):
    job = Job(api, server, "v2", options=access_a, store="etcd")
    try:
        c = job.client
        job.exchange_v2(xh)
        th.wait_keys_retired(c)
        # The session's keys were there, under the prefix, and nothing
        # outside it: job a's role could not have written there anyway.
        assert any(k.startswith(PREFIX_A + "crosshost/session/") for k in etcd.keys(PREFIX_A))
        assert etcd.keys("crosshost/") == [], etcd.keys("crosshost/")
        transfer = lambda: [k for k in etcd.keys(PREFIX_A)  # noqa: E731
                            if k.startswith((PREFIX_A + "crosshost/recv/",
                                             PREFIX_A + "crosshost/desc/"))]
        assert th.poll_until(lambda: not transfer(), 5), transfer()
        job.finish()
    finally:
        job.close()
    assert etcd.keys(PREFIX_A) == [], etcd.keys(PREFIX_A)


def test_a_wrong_password_fails_creation_naming_the_user_not_the_password(api, access_a, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text(PASSWORD_B)
    e = create_fails(api, {**access_a, "etcd_password_file": str(wrong)})
    assert e.code == EC.UNAUTHENTICATED, e
    assert "job-a" in e.message and "etcd_password_file" in e.message, e
    assert "authentication failed" in e.message, e


def test_a_certificate_of_another_ca_or_none_fails_creation_pointing_at_the_tls_options(
    api, access_a, stranger
):
    cert, key = stranger.issue("client-x", "job-a")
    e = create_fails(api, {**access_a, "etcd_cert_file": cert, "etcd_key_file": key})
    assert e.code in (EC.UNAVAILABLE, EC.DEADLINE_EXCEEDED), e
    assert "etcd_cert_file" in e.message and "127.0.0.1" in e.message, e
    no_cert = {k: v for k, v in access_a.items() if k not in ("etcd_cert_file", "etcd_key_file")}
    e = create_fails(api, no_cert)
    assert e.code in (EC.UNAVAILABLE, EC.DEADLINE_EXCEEDED), e
    # A client that does not trust the server's CA does not talk to it.
    e = create_fails(api, {**access_a, "etcd_ca_file": stranger.ca})
    assert e.code in (EC.UNAVAILABLE, EC.DEADLINE_EXCEEDED), e
    assert "etcd_ca_file" in e.message, e


def test_a_client_reaching_for_another_jobs_prefix_is_refused(api, access_a, etcd):
    e = create_fails(api, {**access_a, "etcd_key_prefix": PREFIX_B})
    assert e.code == EC.PERMISSION_DENIED, e
    assert "permission denied" in e.message, e
    # Without a prefix a job's keys would be at the top: refused as well.
    e = create_fails(api, {**access_a, "etcd_key_prefix": ""})
    assert e.code == EC.PERMISSION_DENIED, e
    assert etcd.keys("") == [], etcd.keys("")


def test_tls_options_that_cannot_work_are_invalid_arguments(api, access_a, etcd):
    clear = etcd.url.replace("etcds://", "etcd://")
    e = create_fails(api, {**access_a, "kv_store": clear})
    assert e.code == EC.INVALID_ARGUMENT and "etcds://" in e.message, e
    no_ca = {k: v for k, v in access_a.items() if k != "etcd_ca_file"}
    e = create_fails(api, no_ca)
    assert e.code == EC.INVALID_ARGUMENT and "etcd_ca_file" in e.message, e
    e = create_fails(api, {"etcd_user": "job-a"})
    assert e.code == EC.INVALID_ARGUMENT, e
