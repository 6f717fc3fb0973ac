#!/usr/bin/env python3
"""Checks the Kubernetes manifests in deploy/kubernetes without a cluster.

1. Every object validates with `kubernetes-validate --strict` (the schemas
   ship with the tool; no network) against each version in VERSIONS.
2. The manifests agree with each other and with the plugin: one driver
   name (CSIDriver, the DaemonSet's registration path, every PV's
   csi.driver, the name `arbor csi` answers in GetPluginInfo); the socket
   the plugin serves is the one the sidecars dial and the kubelet is told;
   every PV names a Secret that exists, with only keys the plugin reads;
   every PV's attributes are ones the plugin knows; every PVC binds a PV
   that exists with its access modes; the pods claim PVCs that exist.

Usage: deploy/validate.py [--plugin-source csi/src]; exits non-zero with
each problem on its own line.
"""

import argparse
import glob
import os
import re
import subprocess
import sys

import yaml

VERSIONS = ["1.30.0", "1.37.0"]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def load(folder):
    objs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    objs.append((os.path.basename(path), doc))
    return objs


def validate_schemas(folder):
    files = sorted(glob.glob(os.path.join(folder, "*.yaml")))
    problems = []
    for v in VERSIONS:
        r = subprocess.run(
            ["kubernetes-validate", "--strict", "--quiet", "-k", v, *files],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            problems.append(f"kubernetes-validate --strict -k {v}: {r.stdout.strip()} {r.stderr.strip()}")
    return problems


def plugin_facts(src):
    """The driver name, attribute keys and secret keys from the plugin's source."""
    lib = open(os.path.join(src, "lib.rs")).read()
    vol = open(os.path.join(src, "volume.rs")).read()
    driver = re.search(r'pub const DRIVER_NAME: &str = "([^"]+)"', lib).group(1)
    consts = dict(re.findall(r'pub const (\w+): &str = "([^"]+)"', vol))
    attrs_names = re.search(r"const ATTRIBUTES: \[&str; \d+\] = \[([^\]]+)\]", vol).group(1)
    secret_names = re.search(r"const SECRETS: \[&str; \d+\] = \[([^\]]+)\]", vol).group(1)
    attrs = {consts[n.strip()] for n in attrs_names.split(",") if n.strip()}
    secrets = {consts[n.strip()] for n in secret_names.split(",") if n.strip()}
    return driver, attrs, secrets


def arg_value(args, flag):
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def check_keeper(by_kind, plugin, mounts, volumes):
    """The plugin's --keeper socket is served by arbor-fuse-keeper, a
    DaemonSet of its own (not replaced with the plugin), in a host folder
    both mount, and the keeper sees the kubelet's mounts as the host does."""
    problems = []
    sock = arg_value(plugin["args"], "--keeper")
    if sock is None:
        return ["the plugin runs without --keeper: its container's restart kills the pods' mounts"]
    keepers = [d for d in by_kind.get("DaemonSet", []) if d["metadata"]["name"] == "arbor-fuse-keeper"]
    if len(keepers) != 1:
        return ["no DaemonSet arbor-fuse-keeper serves the plugin's --keeper socket"]
    ds = keepers[0]
    if ds["spec"].get("updateStrategy", {}).get("type") != "OnDelete":
        problems.append("arbor-fuse-keeper is not updateStrategy OnDelete: an upgrade would drop the connections")
    pod = ds["spec"]["template"]["spec"]
    kvolumes = {v["name"]: v for v in pod["volumes"]}
    c = pod["containers"][0]
    if c["args"][0] != "keeper" or arg_value(c["args"], "--socket") != sock:
        problems.append(f"arbor-fuse-keeper runs {c['args']}, not keeper --socket={sock}")
    kmounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    d = os.path.dirname(sock)
    host = lambda ms, vs: vs[ms[d]["name"]]["hostPath"]["path"] if d in ms else None
    if host(mounts, volumes) is None or host(mounts, volumes) != host(kmounts, kvolumes):
        problems.append(f"the plugin and arbor-fuse-keeper do not share the host folder of {d}")
    kubelet = kmounts.get("/var/lib/kubelet")
    if not kubelet or kubelet.get("mountPropagation") not in ("HostToContainer", "Bidirectional"):
        problems.append("arbor-fuse-keeper does not see /var/lib/kubelet's mounts (HostToContainer propagation)")
    return problems


def check_references(objs, driver, attrs, secret_keys):
    problems = []
    by_kind = {}
    for _, o in objs:
        by_kind.setdefault(o["kind"], []).append(o)

    drivers = by_kind.get("CSIDriver", [])
    if [d["metadata"]["name"] for d in drivers] != [driver]:
        problems.append(f"CSIDriver objects {[d['metadata']['name'] for d in drivers]}, expected [{driver!r}]")
    for d in drivers:
        spec = d["spec"]
        want = {"attachRequired": False, "podInfoOnMount": True, "fsGroupPolicy": "None"}
        for k, v in want.items():
            if spec.get(k) != v:
                problems.append(f"CSIDriver {k} is {spec.get(k)!r}, expected {v!r}")

    daemonsets = [d for d in by_kind.get("DaemonSet", []) if d["metadata"]["name"] == "arbor-csi-node"]
    if len(daemonsets) != 1:
        problems.append("no DaemonSet arbor-csi-node")
    for ds in daemonsets:
        pod = ds["spec"]["template"]["spec"]
        containers = {c["name"]: c for c in pod["containers"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        plugin = containers.get("arbor-csi")
        if plugin is None:
            problems.append("the DaemonSet has no arbor-csi container")
            continue
        if plugin["args"][0] != "csi":
            problems.append(f"the plugin container runs {plugin['args'][0]!r}, not csi")
        endpoint = arg_value(plugin["args"], "--endpoint") or ""
        sock = endpoint.replace("unix://", "")
        mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
        sock_dir = os.path.dirname(sock)
        if sock_dir not in mounts:
            problems.append(f"the plugin's socket folder {sock_dir} is not a volume mount")
            continue
        host_dir = volumes[mounts[sock_dir]["name"]]["hostPath"]["path"]
        host_sock = os.path.join(host_dir, os.path.basename(sock))
        if host_dir != f"/var/lib/kubelet/plugins/{driver}":
            problems.append(f"the socket's host folder {host_dir} is not /var/lib/kubelet/plugins/{driver}")
        if not plugin["securityContext"].get("privileged"):
            problems.append("the plugin container is not privileged")
        kubelet = mounts.get("/var/lib/kubelet")
        if not kubelet or kubelet.get("mountPropagation") != "Bidirectional":
            problems.append("/var/lib/kubelet is not mounted with Bidirectional propagation")
        fuse = [m for m in plugin["volumeMounts"] if m["mountPath"] == "/dev/fuse"]
        if not fuse or volumes[fuse[0]["name"]]["hostPath"]["path"] != "/dev/fuse":
            problems.append("/dev/fuse is not given to the plugin")
        problems += check_keeper(by_kind, plugin, mounts, volumes)
        for name in ("node-driver-registrar", "liveness-probe"):
            c = containers.get(name)
            if c is None:
                problems.append(f"the DaemonSet has no {name} sidecar")
                continue
            addr = arg_value(c["args"], "--csi-address")
            cmounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            d = os.path.dirname(addr or "")
            if d not in cmounts or volumes[cmounts[d]]["hostPath"]["path"] != host_dir or os.path.basename(addr) != os.path.basename(sock):
                problems.append(f"{name} dials {addr}, not the plugin's socket {host_sock}")
            if name == "node-driver-registrar":
                reg = arg_value(c["args"], "--kubelet-registration-path")
                if reg != host_sock:
                    problems.append(f"the kubelet is told {reg}, the plugin listens at {host_sock}")
            if name == "liveness-probe":
                port = arg_value(c["args"], "--health-port")
                ports = [p["containerPort"] for p in plugin.get("ports", [])]
                if port is None or int(port) not in ports:
                    problems.append(f"liveness-probe serves {port}, the plugin's probe port is {ports}")

    secrets = {}
    for s in by_kind.get("Secret", []):
        keys = set(s.get("stringData", {})) | set(s.get("data", {}))
        secrets[(s["metadata"].get("namespace", "default"), s["metadata"]["name"])] = keys
    pvs = {}
    for pv in by_kind.get("PersistentVolume", []):
        name = pv["metadata"]["name"]
        csi = pv["spec"].get("csi")
        if not csi:
            continue
        pvs[name] = pv
        if csi["driver"] != driver:
            problems.append(f"PV {name} uses driver {csi['driver']!r}, not {driver!r}")
        va = csi.get("volumeAttributes", {})
        unknown = set(va) - attrs
        if unknown:
            problems.append(f"PV {name} has attributes the plugin does not know: {sorted(unknown)}")
        if "disk" not in va or (("branch" in va) == ("checkpoint" in va)):
            problems.append(f"PV {name} needs disk and one of branch or checkpoint")
        modes = set(pv["spec"]["accessModes"])
        if "checkpoint" in va and modes - {"ReadOnlyMany"}:
            problems.append(f"PV {name} is a checkpoint (read-only) with access modes {sorted(modes)}")
        for ref in ("nodeStageSecretRef", "nodePublishSecretRef"):
            r = csi.get(ref)
            if not r:
                continue
            key = (r.get("namespace", "default"), r["name"])
            if key not in secrets:
                problems.append(f"PV {name} {ref} names Secret {key[0]}/{key[1]}, which is not in the examples")
                continue
            extra = secrets[key] - secret_keys
            if extra:
                problems.append(f"Secret {key[0]}/{key[1]} has keys the plugin does not read: {sorted(extra)}")
            if "branch" in va and "token" not in secrets[key]:
                problems.append(f"PV {name} mounts a branch through its owner but its Secret has no token")

    pvcs = {}
    for pvc in by_kind.get("PersistentVolumeClaim", []):
        ns, name = pvc["metadata"].get("namespace", "default"), pvc["metadata"]["name"]
        pvcs[(ns, name)] = pvc
        vol = pvc["spec"].get("volumeName")
        if vol not in pvs:
            problems.append(f"PVC {ns}/{name} binds PV {vol!r}, which does not exist")
        elif set(pvc["spec"]["accessModes"]) - set(pvs[vol]["spec"]["accessModes"]):
            problems.append(f"PVC {ns}/{name} asks for access modes its PV {vol} does not have")
    for pod in by_kind.get("Pod", []):
        ns = pod["metadata"].get("namespace", "default")
        for v in pod["spec"].get("volumes", []):
            claim = v.get("persistentVolumeClaim", {}).get("claimName")
            if claim and (ns, claim) not in pvcs:
                problems.append(f"Pod {pod['metadata']['name']} claims {ns}/{claim}, which does not exist")
    return problems


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifests", default=os.path.join(HERE, "kubernetes"))
    p.add_argument("--plugin-source", default=os.path.join(ROOT, "csi", "src"))
    args = p.parse_args()
    driver, attrs, secret_keys = plugin_facts(args.plugin_source)
    objs = load(args.manifests)
    problems = validate_schemas(args.manifests) + check_references(objs, driver, attrs, secret_keys)
    for pr in problems:
        print("PROBLEM:", pr)
    kinds = sorted({o["kind"] for _, o in objs})
    print(f"{len(objs)} objects ({', '.join(kinds)}), Kubernetes {' and '.join(VERSIONS)}: "
          f"{'OK' if not problems else str(len(problems)) + ' problems'}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
