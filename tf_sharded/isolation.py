"""A private network for local runs: a local cluster's ports answer on its own loopback only.

TensorFlow's gRPC server listens on every interface of its network namespace,
authenticates nothing and runs any graph a client sends. A local cluster is
meant for one machine, so a run that starts one (`python -m tf_sharded train`,
`demo`, `bench`; the test suite's clusters) first moves into a new user and
network namespace of its own: Linux lets any user do that, the namespace holds
nothing but a loopback interface, and every task and child process the run
starts inherits it. Nothing outside can connect to a port there; the run can
still read and write files as before, but has no network beyond its loopback.

`unshare(2)` only moves a process that runs one thread, so the move happens
before TensorFlow loads: for `python -m tf_sharded ...` when the package is
imported (`enter_for_command`), and for a child process between `fork` and
`exec` (`enter`, as `subprocess.Popen(preexec_fn=...)`). A process that already
runs TensorFlow cannot move: a local cluster started there prints one warning
line naming its ports and the addresses they are reachable on, and
`isolation="required"` makes that an error instead. This module imports the
standard library only, so the package can call it before TensorFlow loads.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys
import threading
from typing import List, Optional, Sequence

MODES = ("auto", "required", "none")
# The mode of runs that do not name one (`--local_cluster_isolation` names it for `train`).
ENV = "TF_SHARDED_ISOLATION"
# Commands of `python -m tf_sharded` that start local clusters.
COMMANDS = ("train", "demo", "bench")
FLAG = "--local_cluster_isolation"

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8914, 0x8915
_IFF_UP = 0x1

# Why this process is not in a namespace of its own (None: it is, or nothing tried to move it).
_not_isolated_because: Optional[str] = None
# How messages name the setting: the `LocalCluster` argument, or the flag where a command set it.
spelling = "isolation"


def enter() -> Optional[str]:
    """Moves this single-threaded process into a new user and network namespace with its loopback up.

    Returns None when it did, else why it could not (the process is then
    unchanged). The new user namespace maps this process's own user and group
    ids, so files it writes belong to the same user as before.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's; this is {sys.platform}"
    uid, gid = os.geteuid(), os.getegid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            request = struct.pack("16sH22x", b"lo", 0)
            flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))
    except OSError as e:  # in the namespace, but without its loopback: nothing could listen or connect
        raise OSError(f"entered a new network namespace but could not bring its loopback up: {e}") from e
    return None


def _mode(argv: Sequence[str], environ) -> str:
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(FLAG + "="):
            return arg.split("=", 1)[1]
    return environ.get(ENV, "auto")


def decide(argv: Sequence[str], environ=os.environ) -> Optional[str]:
    """What `enter_for_command` does for `python -m tf_sharded ARGV`: "enter", "" (the command starts no
    local cluster, or TF_CONFIG names the cluster's machines), or why a local cluster stays on this
    machine's network."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS or list(argv[1:2]) == ["report"] or environ.get("TF_CONFIG"):
        return ""
    mode = _mode(argv, environ)
    if mode == "none":
        return f"{FLAG} none"
    remote = [a for a in argv if "://" in a]
    if remote:
        return f"{remote[0]} needs the network, which a namespace of its own does not have"
    return "enter"


def enter_for_command(argv: Sequence[str]) -> None:
    """Moves a `python -m tf_sharded COMMAND ...` run into its own network, before TensorFlow loads.

    Only commands that start local clusters move (`decide`); a failure to
    move is remembered, and reported when the cluster starts (`check`).
    """
    global _not_isolated_because
    decision = decide(argv)
    if decision != "enter":
        _not_isolated_because = decision or None
    elif threading.active_count() > 1:
        _not_isolated_because = "the process already runs threads"
    else:
        _not_isolated_because = trial() or enter()


def trial() -> Optional[str]:
    """Whether `enter` works here, tried in a forked child: None if it does, else why not.

    A system can allow the new namespaces but not what follows (an AppArmor
    policy that leaves a new user namespace without capabilities, say), and a
    process that entered them cannot come back: so the process moves only
    after a copy of it did.
    """
    if not sys.platform.startswith("linux"):
        return enter()  # says why not, changing nothing
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: report, and exit without running anything of the parent's
        os.close(read)
        try:
            reason = enter() or ""
        except BaseException as e:  # noqa: BLE001  (any failure is the answer)
            reason = str(e) or type(e).__name__
        os.write(write, reason.encode()[:4096])
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        reason = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return reason or None


def join(pid: int) -> None:
    """Moves this single-threaded process into the user and network namespaces of process `pid`.

    For processes that must reach one another (the tasks of a `TF_CONFIG`
    cluster started one by one): the first enters a namespace, the others
    join it. Allowed without privileges when `pid`'s user namespace is one
    this user created.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    files = [open(f"/proc/{pid}/ns/{kind}") for kind in ("user", "net")]
    try:
        for f, flag in zip(files, (_CLONE_NEWUSER, _CLONE_NEWNET)):
            if libc.setns(f.fileno(), flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns({f.name}): {os.strerror(ctypes.get_errno())}")
    finally:
        for f in files:
            f.close()


def exposed_addresses() -> List[str]:
    """This process's non-loopback interfaces, as "name address" (empty in a namespace of its own)."""
    out = []
    try:
        interfaces = socket.if_nameindex()
    except OSError:
        return out
    for _, name in interfaces:
        if name == "lo":
            continue
        address = "?"
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                address = socket.inet_ntoa(reply[20:24])
        except OSError:
            pass  # no IPv4 address (IPv6 only, or down): the interface is still named
        out.append(f"{name} {address}")
    return out


def check(mode: str, ports: Sequence[int]) -> Optional[str]:
    """Whether a local cluster on `ports` may start here: None if it is private, else the warning line.

    Raises RuntimeError (one line) if `mode` is "required" and the ports
    would be reachable from other machines.
    """
    arg = spelling
    if mode not in MODES:
        raise ValueError(f"Argument `{arg}` must be one of {MODES}. Received: {arg}={mode!r}")
    exposed = exposed_addresses()
    if not exposed or mode == "none":
        return None
    why = _not_isolated_because or "this process did not start in a network namespace of its own"
    where = ", ".join(exposed)
    listed = f"ports {', '.join(str(p) for p in ports)}" if ports else "ports"
    required = f"{arg} required" if arg.startswith("--") else f"{arg}='required'"
    if mode == "required":
        raise RuntimeError(
            f"{required}: this process's network reaches other machines ({where}), so the local cluster's "
            f"{listed} would accept their connections ({why})"
        )
    return (
        f"warning: the local cluster's {listed} accept connections from other machines on {where}: "
        f"TensorFlow's servers authenticate nothing ({why}; {required} refuses to start it)"
    )
