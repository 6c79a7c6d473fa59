"""netinfo and the launcher's endpoint helpers: pure decisions, no processes (the namespace tests run them for
real across hosts)."""

from __future__ import annotations

import ipaddress

from ddpkit.base.netinfo import gloo_interface, interface_addresses, is_local_address, resolve, route_to
from ddpkit.base.shape import endpoint_host
from ddpkit.launch.addresses import hosts_endpoint


def test_loopback_routes_over_lo() -> None:
    assert route_to("127.0.0.1") == ("lo", "127.0.0.1")
    assert is_local_address("127.0.0.1") and resolve("127.0.0.1") == "127.0.0.1"


def test_own_address_routes_over_its_interface_not_lo() -> None:
    for name, ips in interface_addresses().items():
        for ip in ips:
            if ipaddress.ip_address(ip).version == 4 and not ipaddress.ip_address(ip).is_loopback:
                assert route_to(ip) == (name, ip)
                assert is_local_address(ip)
                choice = gloo_interface(ip, {})
                assert choice.ifname == name and choice.chosen_by_ddpkit
                assert f"{name} ({ip}) is the interface that routes to the master {ip}" in choice.reason


def test_gloo_interface_leaves_user_and_single_host_alone() -> None:
    user = gloo_interface("10.9.9.9", {"GLOO_SOCKET_IFNAME": "ib0"})
    assert (user.ifname, user.chosen_by_ddpkit) == ("ib0", False) and "was set before" in user.reason
    for master in ("127.0.0.1", "localhost"):
        local = gloo_interface(master, {})
        assert local.ifname is None and not local.chosen_by_ddpkit and "loopback" in local.reason
    assert gloo_interface(None, {}).ifname is None
    unknown = gloo_interface("no-such-host.invalid", {})
    assert unknown.ifname is None and "does not resolve" in unknown.reason


def test_endpoint_parsing_and_loopback_endpoint_left_to_torch() -> None:
    assert endpoint_host("10.0.0.1:29400") == "10.0.0.1"
    assert endpoint_host("[fd00::1]:29400") == "fd00::1"
    assert endpoint_host("node-a") == "node-a"
    assert hosts_endpoint("127.0.0.1:29400") is False  # torch already hosts loopback endpoints
    assert hosts_endpoint("198.51.100.254:29400") is False  # TEST-NET-2: nobody's address
