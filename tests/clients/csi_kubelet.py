#!/usr/bin/env python3
"""Plays the kubelet's calls to `arbor csi` with grpcio, with stubs
generated now from csi/proto/csi.proto (the spec's package, names and
field numbers), for a branch volume mounted through its owner.

Usage: csi_kubelet.py PROTO SOCKET WORKDIR DISK OWNER TOKEN
Prints one line per step; exits non-zero (an assertion) on the first wrong answer.
"""

import atexit
import errno
import importlib
import os
import shutil
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc

proto, socket, work, disk, owner, token = sys.argv[1:7]

# Stubs from the .proto, with the well-known types grpc_tools ships.
out = tempfile.mkdtemp(prefix="csi-stubs-")
atexit.register(shutil.rmtree, out, True)
well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
rc = protoc.main(["protoc", f"-I{os.path.dirname(proto)}", f"-I{well_known}", f"--python_out={out}",
                  f"--grpc_python_out={out}", os.path.basename(proto)])
assert rc == 0, f"protoc failed: {rc}"
sys.path.insert(0, out)
pb = importlib.import_module("csi_pb2")
rpc = importlib.import_module("csi_pb2_grpc")

# grpc C-core sends the socket path as :authority, which HTTP/2 servers
# built on h2 (tonic) refuse; grpc-go (the kubelet) sends "localhost".
channel = grpc.insecure_channel(f"unix://{socket}", options=[("grpc.default_authority", "localhost")])
identity = rpc.IdentityStub(channel)
node = rpc.NodeStub(channel)


def step(msg):
    print(msg, flush=True)


def code_of(call, req):
    try:
        call(req, timeout=120)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split(" ")[4] == path and line.split(" - ")[1].startswith("fuse") for line in f)


RWX = pb.VolumeCapability.AccessMode.MULTI_NODE_MULTI_WRITER


def cap(mode=RWX):
    return pb.VolumeCapability(mount=pb.VolumeCapability.MountVolume(),
                               access_mode=pb.VolumeCapability.AccessMode(mode=mode))


ctx = {"disk": disk, "branch": "main", "server": owner}
secrets = {"token": token}
staging = os.path.join(work, "py-globalmount")
a, b, ro = (os.path.join(work, "py-pods", p, "data") for p in ("a", "b", "ro"))
for t in (a, b, ro):
    os.makedirs(os.path.dirname(t), exist_ok=True)


def stage(**over):
    kw = dict(volume_id="py-vol", staging_target_path=staging, volume_capability=cap(),
              secrets=secrets, volume_context=ctx)
    kw.update(over)
    return pb.NodeStageVolumeRequest(**kw)


def publish(target, readonly=False, **over):
    kw = dict(volume_id="py-vol", staging_target_path=staging, target_path=target,
              volume_capability=cap(), readonly=readonly)
    kw.update(over)
    return pb.NodePublishVolumeRequest(**kw)


info = identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
assert info.name == "csi.arbor.dev", info
step(f"GetPluginInfo: {info.name} {info.vendor_version}")
assert identity.Probe(pb.ProbeRequest(), timeout=10).ready.value
ni = node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10)
assert ni.node_id == "node-a", ni
caps = node.NodeGetCapabilities(pb.NodeGetCapabilitiesRequest(), timeout=10)
kinds = [c.rpc.type for c in caps.capabilities]
assert kinds == [pb.NodeServiceCapability.RPC.STAGE_UNSTAGE_VOLUME], kinds
step("NodeGetInfo, NodeGetCapabilities: STAGE_UNSTAGE_VOLUME")

INVALID = grpc.StatusCode.INVALID_ARGUMENT
assert code_of(node.NodeStageVolume, stage(volume_id="")) == INVALID
assert code_of(node.NodeStageVolume, stage(staging_target_path="")) == INVALID
assert code_of(node.NodeStageVolume, stage(volume_context={"branch": "main"})) == INVALID
assert code_of(node.NodeStageVolume, pb.NodeStageVolumeRequest(volume_id="py-vol", staging_target_path=staging,
                                                               secrets=secrets, volume_context=ctx)) == INVALID
assert code_of(node.NodePublishVolume, publish("")) == INVALID
assert code_of(node.NodeUnpublishVolume, pb.NodeUnpublishVolumeRequest(volume_id="py-vol")) == INVALID
assert code_of(node.NodeUnstageVolume, pb.NodeUnstageVolumeRequest(volume_id="py-vol")) == INVALID
assert not mounted(staging)
step("missing fields: INVALID_ARGUMENT")

node.NodeStageVolume(stage(), timeout=120)
assert mounted(staging)
node.NodeStageVolume(stage(), timeout=120)
assert code_of(node.NodeStageVolume, stage(volume_context={**ctx, "cacheSize": "1G"})) == grpc.StatusCode.ALREADY_EXISTS
step("NodeStageVolume: mounted; again OK; other attributes ALREADY_EXISTS")

node.NodePublishVolume(publish(a), timeout=60)
node.NodePublishVolume(publish(b), timeout=60)
with open(os.path.join(a, "from-python"), "wb") as f:
    f.write(b"written in pod a")
with open(os.path.join(b, "from-python"), "rb") as f:
    assert f.read() == b"written in pod a"
node.NodePublishVolume(publish(a), timeout=60)
assert code_of(node.NodePublishVolume, publish(a, readonly=True)) == grpc.StatusCode.ALREADY_EXISTS
step("NodePublishVolume: two pods share the file; again OK; other arguments ALREADY_EXISTS")

node.NodePublishVolume(publish(ro, readonly=True), timeout=60)
try:
    with open(os.path.join(ro, "refused"), "wb") as f:
        f.write(b"x")
    raise AssertionError("a read-only publish took a write")
except OSError as e:
    assert e.errno == errno.EROFS, e
step("read-only publish: EROFS")

for t in (a, b, ro):
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="py-vol", target_path=t), timeout=60)
    node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(volume_id="py-vol", target_path=t), timeout=60)
    assert not os.path.exists(t), t
step("NodeUnpublishVolume twice: OK, targets gone")

node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="py-vol", staging_target_path=staging), timeout=120)
assert not mounted(staging)
node.NodeUnstageVolume(pb.NodeUnstageVolumeRequest(volume_id="py-vol", staging_target_path=staging), timeout=120)
step("NodeUnstageVolume twice: OK, no mount left at the staging path")
print("ALL OK")
