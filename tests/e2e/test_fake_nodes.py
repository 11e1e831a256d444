"""The fake nodes never look lost: kwok renews each one's Lease, the heartbeat the node-lifecycle controller
reads besides the node status.

Without it the only heartbeat is kwok's status update every 20-25 s (gaps of 41 s measured on a busy two-core
machine), and once a gap passes the controller manager's grace, the node goes Unknown and every pod on it is
marked NotReady for good (kwok makes only Pending pods Ready): each later rollout on that node then waits
forever. With a 12 s grace and no leases, both pods of a Deployment went NotReady 20 s in and stayed so; with
leases and a 15 s grace they stayed Ready for the 70 s watched (see controlplane.py's NODE_LEASE_SECONDS).
"""
from __future__ import annotations

from e2e_support import get_json, wait_for

from baton_testing.kube.controlplane import NODE_LEASE_SECONDS, ControlPlane
from baton_testing.kube.fake_nodes import FAKE_NODES


def _renewed(cp: ControlPlane) -> dict[str, str]:
    leases = get_json(cp, "leases", "-n", "kube-node-lease")["items"]
    return {lease["metadata"]["name"]: lease["spec"].get("renewTime", "") for lease in leases}


def test_kwok_renews_every_fake_nodes_lease(control_plane: ControlPlane):
    nodes = {n["metadata"]["name"] for n in FAKE_NODES}
    first = wait_for(lambda: (r := _renewed(control_plane)) and nodes <= r.keys() and r, "a Lease for every fake node")
    # kwok renews a quarter of the way through the duration, as a kubelet does
    wait_for(lambda: (r := _renewed(control_plane)) and all(r.get(n, "") > first[n] for n in nodes),
             "every fake node's Lease renewed", timeout=NODE_LEASE_SECONDS / 2 + 5)
