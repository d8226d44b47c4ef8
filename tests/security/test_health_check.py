"""`python -m kvpager_tools.health`, the compose health check: SERVING is
exit 0; with the KVPAGER_TLS_* variables it checks over mutual TLS (so the
check stays green once TLS is on) and verifies the server's name."""

from __future__ import annotations

import os
import subprocess
import sys

from memory_service.service import MemoryConfig, MemoryServer


def health(address: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPAGER_")}
    return subprocess.run([sys.executable, "-m", "kvpager_tools.health", "--timeout-s", "5"], check=False,
                          capture_output=True, text=True, timeout=60,
                          env={**base, "KVPAGER_HEALTH_ADDRESS": address, **env})


async def test_health_check_over_mutual_tls(dev_certs):
    from kvpager.server import TlsConfig

    tls = TlsConfig(str(dev_certs / "server.crt"), str(dev_certs / "server.key"), ca_file=str(dev_certs / "ca.crt"),
                    require_client_auth=True)
    server = await MemoryServer(MemoryConfig(port=0, tls=tls, admin_token="adm1n")).start()
    try:
        mtls = {"KVPAGER_TLS_CA": str(dev_certs / "ca.crt"), "KVPAGER_TLS_CLIENT_CERT": str(dev_certs / "client.crt"),
                "KVPAGER_TLS_CLIENT_KEY": str(dev_certs / "client.key")}
        import asyncio

        ok = await asyncio.to_thread(health, server.address, **mtls)
        assert ok.returncode == 0 and ok.stdout.strip() == f"{server.address}: SERVING", ok.stderr
        # no token needed, but TLS is: a plaintext check fails, and so does a certificate for another name
        plain = await asyncio.to_thread(health, server.address)
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        wrong = await asyncio.to_thread(health, server.address, KVPAGER_HEALTH_SERVER_NAME="gateway", **mtls)
        assert wrong.returncode == 1
        missing = await asyncio.to_thread(health, server.address, KVPAGER_TLS_CA="/no/ca.crt")
        assert missing.returncode == 2 and missing.stderr.strip() == "kvpager health: --tls-ca /no/ca.crt: no such file"
    finally:
        await server.stop(0)


async def test_not_serving_is_exit_1():
    server = await MemoryServer(MemoryConfig(port=0)).start()
    try:
        await server.runtime.set_serving(False)
        import asyncio

        out = await asyncio.to_thread(health, server.address)
        assert out.returncode == 1 and out.stdout.strip() == f"{server.address}: NOT_SERVING"
    finally:
        await server.stop(0)
