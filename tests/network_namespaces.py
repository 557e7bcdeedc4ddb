"""Two "machines" on one box: network namespaces joined by a veth pair, one torchrun per namespace (node ranks 0
and 1, static rendezvous over 10.x addresses), each running tests/distributed/tp_node.py. Needs root and
iproute2 (tests/distributed/test_tensor_parallel.py and test_ep_two_nodes.py skip with the reason otherwise)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

NODE = str(Path(__file__).parent / "distributed" / "tp_node.py")
# the nodes import this checkout's mlaserve (not whichever one the environment has installed)
PYTHONPATH = os.pathsep.join(p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)


def namespaces_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns) to build two network namespaces"
    probe = f"mlaprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "ip netns add is not permitted here (no CAP_NET_ADMIN)"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def assert_clean_exit(rank: int, code: int, log: str) -> None:
    """Node `rank` runs rank `rank` alone; its torchrun exits 0 only when that rank did (a rank that ends by a
    signal, e.g. SIGABRT while the interpreter exits, makes torchrun report "exitcode: -6" and exit 1)."""
    done = f"tp_node: rank done {rank}" in log
    when = "after its work was done (a teardown failure)" if done else "before its work was done"
    assert code == 0, f"rank {rank} (node {rank}) exited with code {code} {when}; its log:\n{log}"


def run_two_nodes(node_args: list[str], port: int) -> list[str]:
    """tp_node.py `node_args` on two nodes (one process each); asserts every rank exits 0 -> their logs. The namespaces
    and the veth pair are named after this process (parallel test runs do not collide) and removed after."""
    tag = f"{os.getpid() % 100000}"
    ns, veth, net = [f"mla{tag}a", f"mla{tag}b"], [f"mv{tag}a", f"mv{tag}b"], f"10.{os.getpid() % 200 + 20}.77"
    ip = ["ip", "netns", "exec"]
    setup = [
        *(["ip", "netns", "add", n] for n in ns),
        ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
        *(["ip", "link", "set", v, "netns", n] for v, n in zip(veth, ns)),
        *([*ip, n, "ip", "addr", "add", f"{net}.{i + 1}/24", "dev", v] for i, (v, n) in enumerate(zip(veth, ns))),
        *([*ip, n, "ip", "link", "set", v, "up"] for v, n in zip(veth, ns)),
        *([*ip, n, "ip", "link", "set", "lo", "up"] for n in ns),
    ]
    procs: list[subprocess.Popen] = []
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True)
        for rank, (n, v) in enumerate(zip(ns, veth)):
            env = dict(os.environ, GLOO_SOCKET_IFNAME=v, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH)
            cmd = [*ip, n, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            cmd += ["--node-rank", str(rank), "--master-addr", f"{net}.1", "--master-port", str(port)]
            cmd += [NODE, *node_args]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            )
        logs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
        for rank, (p, log) in enumerate(zip(procs, logs)):
            assert_clean_exit(rank, p.returncode, log)
        return logs
    finally:
        for p in procs:  # a node still running (a hang, a timeout): its torchrun and its rank, by their session
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
