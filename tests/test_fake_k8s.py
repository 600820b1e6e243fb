"""The fake API server enforces the rules we rely on, through the official client, unmodified."""
import threading

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException


def pod(name, labels=None, gates=None, priority=None):
    spec = {"containers": [{"name": "c", "image": "busybox"}]}
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def test_create_get_list_with_selectors(k8s):
    fake, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("a", pod("p1", {"app": "x", "tier": "gpu"}))
    core.create_namespaced_pod("a", pod("p2", {"app": "y"}))
    core.create_namespaced_pod("b", pod("p3", {"app": "x"}))
    assert core.read_namespaced_pod("p1", "a").metadata.labels["tier"] == "gpu"
    names = lambda r: sorted(p.metadata.name for p in r.items)  # noqa: E731
    assert names(core.list_namespaced_pod("a", label_selector="app=x")) == ["p1"]
    assert names(core.list_pod_for_all_namespaces(label_selector="app in (x)")) == ["p1", "p3"]
    assert names(core.list_namespaced_pod("a", label_selector="app!=x")) == ["p2"]
    assert names(core.list_namespaced_pod("a", label_selector="tier")) == ["p1"]
    assert names(core.list_namespaced_pod("a", label_selector="!tier")) == ["p2"]
    assert names(core.list_pod_for_all_namespaces(field_selector="metadata.namespace=b")) == ["p3"]
    assert names(core.list_namespaced_pod("a", field_selector="status.phase=Pending,metadata.name!=p1")) == ["p2"]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("a", pod("p1"))
    assert e.value.status == 409


def test_stale_update_conflicts(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    cm = core.create_namespaced_config_map("a", {"metadata": {"name": "c"}, "data": {"k": "1"}})
    cm.data["k"] = "2"
    core.replace_namespaced_config_map("c", "a", cm)
    cm.data["k"] = "3"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_config_map("c", "a", cm)
    assert e.value.status == 409
    assert core.read_namespaced_config_map("c", "a").data["k"] == "2"


def test_patches_merge_strategic_json(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("a", pod("p", {"a": "1"}))
    core.patch_namespaced_pod("p", "a", {"metadata": {"labels": {"b": "2"}}})  # strategic by default
    p = core.read_namespaced_pod("p", "a")
    assert p.metadata.labels == {"a": "1", "b": "2"}
    api.call_api("/api/v1/namespaces/a/pods/p", "PATCH", header_params={"Content-Type": "application/json-patch+json"},
                 body=[{"op": "remove", "path": "/metadata/labels/a"}], response_type="object", _return_http_data_only=True)
    assert core.read_namespaced_pod("p", "a").metadata.labels == {"b": "2"}
    api.call_api("/api/v1/namespaces/a/pods/p", "PATCH", header_params={"Content-Type": "application/merge-patch+json"},
                 body={"metadata": {"labels": {"b": None, "c": "3"}}}, response_type="object", _return_http_data_only=True)
    assert core.read_namespaced_pod("p", "a").metadata.labels == {"c": "3"}


def test_priority_immutable_and_gates_only_removable(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("a", pod("p", gates=["g1", "g2"], priority=5))
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", "a", {"spec": {"priority": 10}})
    assert e.value.status == 422 and "immutable" in e.value.body
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_pod("p", "a", {"spec": {"schedulingGates": [{"name": "g3"}]}})
    assert e.value.status == 422 and "only deletion" in e.value.body
    api.call_api("/api/v1/namespaces/a/pods/p", "PATCH", header_params={"Content-Type": "application/json-patch+json"},
                 body=[{"op": "remove", "path": "/spec/schedulingGates/0"}], response_type="object",
                 _return_http_data_only=True)
    assert [g.name for g in core.read_namespaced_pod("p", "a").spec.scheduling_gates] == ["g2"]


def test_binding_refused_while_gated_then_binds(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespaced_pod("a", pod("p", gates=["g"]))
    body = client.V1Binding(metadata=client.V1ObjectMeta(name="p"), target=client.V1ObjectReference(kind="Node", name="n1"))
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod_binding("p", "a", body, _preload_content=False)
    assert e.value.status == 409
    core.patch_namespaced_pod("p", "a", {"spec": {"schedulingGates": None}})
    core.create_namespaced_pod_binding("p", "a", body, _preload_content=False)
    assert core.read_namespaced_pod("p", "a").spec.node_name == "n1"


def test_status_subresource(k8s):
    _, api = k8s
    co = client.CustomObjectsApi(api)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
           "spec": {"pytorchReplicaSpecs": {}}, "status": {"conditions": [{"type": "Hacked"}]}}
    co.create_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs", job)
    got = co.get_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs", "j")
    assert all(c["type"] != "Hacked" for c in got.get("status", {}).get("conditions", []))
    got["status"] = {"conditions": [{"type": "Running", "status": "True"}]}
    got["spec"]["runPolicy"] = {"backoffLimit": 9}
    co.replace_namespaced_custom_object_status("kubeflow.org", "v1", "a", "pytorchjobs", "j", got)
    after = co.get_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs", "j")
    assert after["status"]["conditions"][-1]["type"] == "Running" and "runPolicy" not in after["spec"]


def test_watch_from_resource_version_and_410(k8s):
    fake, api = k8s
    core = client.CoreV1Api(api)
    first = core.create_namespaced_config_map("a", {"metadata": {"name": "c0"}})
    rv = first.metadata.resource_version
    seen = []

    def watcher():
        for ev in watch.Watch().stream(core.list_namespaced_config_map, "a", resource_version=rv, timeout_seconds=3):
            seen.append((ev["type"], ev["object"].metadata.name))
            if len(seen) == 2:
                break

    t = threading.Thread(target=watcher)
    t.start()
    core.create_namespaced_config_map("a", {"metadata": {"name": "c1"}})
    core.delete_namespaced_config_map("c1", "a")
    t.join(10)
    assert seen == [("ADDED", "c1"), ("DELETED", "c1")]
    with fake.lock:  # age the history: the old RV falls out of the retained window
        for i in range(fake.events.maxlen + 5):
            fake.create("configmaps", "z", {"metadata": {"name": f"f{i}"}}, "v1")
    with pytest.raises(ApiException) as e:
        for _ in watch.Watch().stream(core.list_namespaced_config_map, "a", resource_version=rv, timeout_seconds=2):
            pass
    assert e.value.status == 410


def test_forbidden_and_missing_crd(k8s):
    fake, api = k8s
    fake.denied.add(("list", "pods"))
    with pytest.raises(ApiException) as e:
        client.CoreV1Api(api).list_namespaced_pod("a")
    import json

    assert e.value.status == 403 and 'cannot list resource "pods"' in json.loads(e.value.body)["message"]
    fake.missing_groups.add("kubeflow.org")
    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(api).list_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs")
    assert e.value.status == 404


def test_operator_simulation_and_logs(k8s):
    fake, api = k8s
    co = client.CustomObjectsApi(api)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
           "spec": {"pytorchReplicaSpecs": {
               "Master": {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}}},
               "Worker": {"replicas": 2, "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}}}}}}
    co.create_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs", job)
    core = client.CoreV1Api(api)
    pods = core.list_namespaced_pod("a", label_selector="training.kubeflow.org/job-name=j").items
    assert sorted(p.metadata.name for p in pods) == ["j-master-0", "j-worker-0", "j-worker-1"]
    for p in pods:
        fake.set_pod_phase("a", p.metadata.name, "Running")
    cond = lambda: co.get_namespaced_custom_object("kubeflow.org", "v1", "a", "pytorchjobs", "j")["status"]["conditions"][-1]  # noqa: E731
    assert cond()["type"] == "Running"
    fake.append_log("a", "j-master-0", "epoch 1\nepoch 2\n")
    assert core.read_namespaced_pod_log("j-master-0", "a", tail_lines=1) == "epoch 2\n"
    fake.set_pod_phase("a", "j-worker-1", "Failed", reason="OOMKilled")
    assert cond()["type"] == "Failed" and "OOMKilled" in cond()["message"]


def test_cluster_scoped_resources_and_leases(k8s):
    fake, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "team-a"}})
    core.create_node({"metadata": {"name": "gpu-1", "labels": {"nvidia.com/gpu.present": "true"}},
                      "status": {"allocatable": {"nvidia.com/gpu": "8"}}})
    assert [n.metadata.name for n in core.list_node(label_selector="nvidia.com/gpu.present=true").items] == ["gpu-1"]
    assert core.read_namespace("team-a").metadata.name == "team-a"
    coord = client.CoordinationV1Api(api)
    lease = coord.create_namespaced_lease("team-a", {"metadata": {"name": "fairshare-leader"},
                                                     "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}})
    lease.spec.holder_identity = "b"
    coord.replace_namespaced_lease("fairshare-leader", "team-a", lease)
    lease.spec.holder_identity = "c"  # stale: a second leader must not win the race
    with pytest.raises(ApiException) as e:
        coord.replace_namespaced_lease("fairshare-leader", "team-a", lease)
    assert e.value.status == 409
    assert coord.read_namespaced_lease("fairshare-leader", "team-a").spec.holder_identity == "b"
    core.create_namespaced_event("team-a", {"metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "name": "p"},
                                            "reason": "FairShareWaiting", "message": "behind 3 gangs"})
    assert core.list_namespaced_event("team-a").items[0].reason == "FairShareWaiting"
    core.create_namespaced_secret("team-a", {"metadata": {"name": "s"}, "stringData": {"k": "v"}})
    core.create_namespaced_service_account("team-a", {"metadata": {"name": "sa"}})
    assert core.read_namespaced_service_account("sa", "team-a").metadata.name == "sa"


def test_a_resource_quota_refuses_pods_over_it_and_events_select_by_their_fields(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    core.create_namespaced_resource_quota("a", {"metadata": {"name": "q"}, "spec": {"hard": {
        "requests.nvidia.com/gpu": "1", "pods": "2"}}})
    gpu = pod("g1")
    gpu["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}  # requests default to limits
    core.create_namespaced_pod("a", gpu)
    gpu["metadata"]["name"] = "g2"
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("a", gpu)
    assert e.value.status == 403 and "exceeded quota: q, requested: requests.nvidia.com/gpu=1, used: " \
                                      "requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1" in e.value.body
    core.create_namespaced_pod("a", pod("c1"))  # no GPU: only the pod count
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("a", pod("c2"))
    assert e.value.status == 403 and "limited: pods=2" in e.value.body
    core.create_namespaced_pod("b", pod("c2"))  # another namespace, no quota

    core.create_namespaced_event("a", {"metadata": {"name": "e1"}, "type": "Warning", "reason": "FailedCreate",
                                       "involvedObject": {"kind": "Job", "name": "j"}})
    core.create_namespaced_event("a", {"metadata": {"name": "e2"}, "type": "Normal", "reason": "Created",
                                       "involvedObject": {"kind": "Job", "name": "j"}})
    assert [ev.metadata.name for ev in core.list_namespaced_event("a", field_selector="type=Warning").items] == ["e1"]
    assert [ev.metadata.name for ev in core.list_namespaced_event(
        "a", field_selector="involvedObject.name=j,reason=Created").items] == ["e2"]
    with pytest.raises(ApiException) as e:
        core.list_namespaced_event("a", field_selector="spec.nodeName=n1")  # a pod's field, not an event's
    assert e.value.status == 400


def test_a_pod_whose_mounts_name_no_volume_or_share_a_path_is_invalid(k8s):
    _, api = k8s
    core = client.CoreV1Api(api)
    p = pod("v1")
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("a", p)
    assert e.value.status == 422 and 'Pod \\"v1\\" is invalid: spec.containers[0].volumeMounts[0].name: ' \
                                      'Not found: \\"dshm\\"' in e.value.body
    p["spec"]["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "shm", "emptyDir": {}}]
    p["spec"]["containers"][0]["volumeMounts"].append({"name": "shm", "mountPath": "/dev/shm"})
    with pytest.raises(ApiException) as e:
        core.create_namespaced_pod("a", p)
    assert e.value.status == 422 and 'spec.containers[0].volumeMounts[1].mountPath: Invalid value: ' \
                                     '\\"/dev/shm\\": must be unique' in e.value.body
    p["spec"]["containers"][0]["volumeMounts"].pop()
    assert core.create_namespaced_pod("a", p).spec.volumes[0].empty_dir.medium == "Memory"


def test_a_client_that_hangs_up_is_not_a_server_error(_fake_k8s_server, capfd):
    """A client resetting its keep-alive connection (as the official client does when a watch is
    stopped early) prints no traceback into the test output; a real API server does not either."""
    import socket
    import struct
    import time
    from urllib.parse import urlparse

    fake, url = _fake_k8s_server
    u = urlparse(url)

    def ask(path: bytes) -> bytes:
        s = socket.create_connection((u.hostname, u.port))
        s.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        got = s.recv(65536)
        # SO_LINGER 0: close with a RST, as a client dropping a socket mid-keep-alive does
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        time.sleep(0.3)  # the server's thread reads the next request line and meets the reset
        return got

    assert ask(b"/version").split(b"\r\n", 1)[0].endswith(b" 200 OK")
    assert ask(b"/api/v1/namespaces/a/pods").split(b"\r\n", 1)[0].endswith(b" 200 OK")
    assert "Exception occurred" not in capfd.readouterr().err
