"""The real node's network keeps every packet on this machine: pods live on the
cluster's own bridge with routes only to the pod subnet and the Service range,
nothing is masqueraded, and forwarding off the bridge is dropped; the cluster
DNS (CoreDNS on the bridge) answers cluster names and refuses every other
name. These tests read configuration and ask that DNS; the only traffic they
cause is pod -> host on the bridge."""
from __future__ import annotations

import ipaddress
import subprocess

import pytest

import localcluster
import localcluster_dns
import localnode

pytestmark = [pytest.mark.cluster, pytest.mark.node]


def run_pod(kube, namespace: str, name: str, image: str, script: str) -> str:
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                "spec": {"restartPolicy": "Never", "nodeName": localnode.NODE_NAME,
                         "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True},
                         "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never",
                                         "command": ["/bin/sh", "-c", script],
                                         "securityContext": {"readOnlyRootFilesystem": True,
                                                             "allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}})
    kube.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", f"pod/{name}", "-n", namespace,
                 "--timeout=90s", timeout=100)
    return kube.kubectl("logs", name, "-n", namespace).stdout


def routes(proc_net_route: str) -> list[ipaddress.IPv4Network]:
    out = []
    for line in proc_net_route.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or not fields[1].strip():
            continue
        dest, mask = (ipaddress.IPv4Address(bytes.fromhex(h)[::-1]) for h in (fields[1], fields[7]))
        out.append(ipaddress.IPv4Network(f"{dest}/{mask}"))
    return out


def test_pods_have_no_route_off_the_machine(node, namespace, images):
    logs = run_pod(node, namespace, "routes", images["busybox"]["ref"], "cat /proc/net/route; cat /etc/resolv.conf")
    nets = routes(logs)
    assert ipaddress.IPv4Network("0.0.0.0/0") not in nets
    assert set(nets) == {ipaddress.IPv4Network(localnode.POD_CIDR), ipaddress.IPv4Network(localcluster.SERVICE_CIDR)}
    # The only DNS server is the cluster's, on the bridge; never the machine's resolver.
    nameservers = [line.split()[1] for line in logs.splitlines() if line.startswith("nameserver")]
    assert nameservers == [localnode.NODE_IP]
    assert f"search {namespace}.svc.{localcluster_dns.DOMAIN} svc.{localcluster_dns.DOMAIN}" in logs


def test_cluster_dns_answers_cluster_names_and_refuses_the_rest(node, namespace, images):
    """Service names and a headless Service's per-pod names (what a StatefulSet's
    and an LWS group's pods use to find each other) resolve; any other name is
    REFUSED by the server itself: it has nothing to forward to."""
    node.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "peers", "namespace": namespace},
                "spec": {"clusterIP": "None", "selector": {"app": "peer"}, "publishNotReadyAddresses": True}})
    node.apply({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "peer", "namespace": namespace, "labels": {"app": "peer"}},
                "spec": {"nodeName": localnode.NODE_NAME, "hostname": "peer-0", "subdomain": "peers",
                         "terminationGracePeriodSeconds": 0,
                         "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True},
                         "containers": [{"name": "c", "image": images["busybox"]["ref"], "imagePullPolicy": "Never",
                                         "command": ["sleep", "600"],
                                         "securityContext": {"readOnlyRootFilesystem": True,
                                                             "allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}})
    node.kubectl("wait", "--for=jsonpath={.status.podIP}", "pod/peer", "-n", namespace, "--timeout=60s", timeout=70)
    peer_ip = node.get_json("pod", "peer", "-n", namespace)["status"]["podIP"]
    domain = localcluster_dns.DOMAIN
    names = {"service": f"kubernetes.default.svc.{domain}", "peer": f"peer-0.peers.{namespace}.svc.{domain}",
             "outside": "example.com"}
    # The per-pod record appears once the EndpointSlice controller has seen the pod: ask until then (60 tries).
    script = "; ".join(f"echo '== {key}'; i=0; until nslookup {name} || [ {key} != peer ] || [ $i -ge 60 ]; "
                       f"do i=$((i+1)); sleep 1; done" for key, name in names.items())
    logs = run_pod(node, namespace, "lookups", images["busybox"]["ref"], script)
    answers = {part.split("\n", 1)[0]: addresses(part) for part in logs.split("== ")[1:]}
    kubernetes_service = str(ipaddress.ip_network(localcluster.SERVICE_CIDR)[1])
    assert answers["service"] == [kubernetes_service], logs
    assert answers["peer"] == [peer_ip], logs
    outside = logs.split("== outside", 1)[1]
    assert answers["outside"] == [] and "can't find example.com: REFUSED" in outside, logs


def addresses(nslookup: str) -> list[str]:
    """The addresses busybox's nslookup printed as answers (after a `Name:` line; the
    `Address:` before it is the server's)."""
    _, found, answers = nslookup.partition("\nName:")
    return sorted({line.split()[1] for line in answers.splitlines() if line.startswith("Address:")}) if found else []

def test_nothing_masquerades_or_forwards_pod_traffic():
    nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True).stdout
    masquerades = [line for line in nat.splitlines() if "MASQUERADE" in line]
    # kube-proxy's one rule masquerades only packets it marked for a Service
    # endpoint (which lives on the bridge); the CNI plugin adds none (ipMasq false).
    assert all("KUBE-POSTROUTING" in line for line in masquerades), masquerades
    assert not any(localnode.POD_CIDR in line for line in masquerades)
    # The guard is the first rule of the first table forwarded packets traverse
    # (mangle before filter), where kube-proxy, which puts its accepting rules
    # at the top of filter's FORWARD whenever it resyncs, never writes.
    mangle = ["iptables", "-t", localnode.GUARD_TABLE]
    rules = subprocess.run([*mangle, "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
    assert rules.splitlines()[1] == f"-A FORWARD -j {localnode.GUARD_CHAINS['FORWARD']}", rules
    for table in ("raw", "mangle"):  # nothing accepts before it
        dump = subprocess.run(["iptables-save", "-t", table], capture_output=True, text=True, check=True).stdout
        assert not [line for line in dump.splitlines() if "-j ACCEPT" in line], dump
    guard = subprocess.run([*mangle, "-S", localnode.GUARD_CHAINS["FORWARD"]], capture_output=True,
                           text=True, check=True).stdout
    assert f"-A FERRY-FORWARD -s {localnode.POD_CIDR} -j DROP" in guard
    # The bridge and its address are the harness's own: the CNI plugin is not
    # a gateway, so it never switches IP forwarding on.
    bridge = subprocess.run(["ip", "-4", "addr", "show", localnode.BRIDGE], capture_output=True, text=True).stdout
    assert f"{localnode.NODE_IP}/24" in bridge


def test_the_api_server_is_advertised_on_the_bridge(node):
    endpoints = node.get_json("endpointslices", "-n", "default", "-l", "kubernetes.io/service-name=kubernetes")
    addresses = {a for s in endpoints["items"] for e in s["endpoints"] for a in e["addresses"]}
    assert addresses == {localnode.NODE_IP}
