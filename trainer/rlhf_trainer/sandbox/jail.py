"""The kernel's walls around one sandbox call: namespaces, mounts, identity, rlimits.

Linux only, standard library only (``ctypes`` for the calls Python 3.11's ``os`` lacks), and
imported by the worker alone: each step is one function, called in the order the worker's
processes need them (`rlhf_trainer.sandbox.worker`). Each raises `OSError` naming the call that
failed; the worker turns that into "sandbox setup failed" and nothing of the call runs.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET
"""A call's own mounts, host name, System V IPC, processes and network (no interface up)."""

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442
"""The same number on every architecture the generic syscall table serves (x86-64, arm64)."""
CAPABILITY_VERSION_3 = 0x20080522

SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")
"""World-writable places every image has: a call gets empty private ones, so nothing it writes
there is seen by the pod or by the next call."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"{what}: {os.strerror(number)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def raw(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    result = _libc.mount(
        raw(source), raw(target), raw(fstype), ctypes.c_ulong(flags), raw(data) if data else None
    )
    _check(result, f"mount {target}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def die_with_parent() -> None:
    """SIGKILL when the parent goes (the server, or the call's parent): no call outlives the
    process that would stop it. The caller checks its parent did not already go."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def not_dumpable() -> None:
    """Keep a process's memory (the server's token) away from processes of its own uid: its
    /proc files become root's, and ptrace is refused."""
    prctl(PR_SET_DUMPABLE, 0)


def map_own_ids() -> None:
    """In a fresh user namespace, map the caller's own uid and gid (nothing more is allowed
    without a privileged helper): files keep their owners, and the namespace may mount."""
    uid, gid = os.geteuid(), os.getegid()
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def readonly_tree(path: str = "/") -> bool:
    """Make every mount under `path` read-only in this mount namespace (``mount_setattr``,
    Linux 5.12+); False where the kernel has no such call (the call's uid is then what keeps
    it from writing the pod's files)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    result = _libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.c_uint(AT_RECURSIVE),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    return result == 0


def private_mounts(workdir: str, size_bytes: int, uid: int, gid: int, hide: Iterable[str]) -> bool:
    """A call's file system, in its own mount namespace: nothing propagates out, everything
    read-only (where the kernel can), empty size-bounded tmpfs on the shared writable places and
    on `workdir` (owned by the call's user), the paths in `hide` (the token file) covered by
    /dev/null, and a /proc of the call's own PID namespace. Whether the tree is read-only."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    readonly = readonly_tree("/")
    size = f"size={max(size_bytes, 4096)}"
    flags = MS_NOSUID | MS_NODEV
    for place in SHARED_WRITABLE:
        if Path(place).is_dir() and not Path(place).is_symlink():
            mount("tmpfs", place, "tmpfs", flags, f"{size},mode=1777")
    Path(workdir).mkdir(parents=True, exist_ok=True)  # under a fresh /tmp: made again there
    mount("tmpfs", workdir, "tmpfs", flags, f"{size},mode=700,uid={uid},gid={gid}")
    for path in hide:
        if Path(path).is_file():
            mount("/dev/null", path, None, MS_BIND)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return readonly


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_privileges(uid: int | None, gid: int | None) -> None:
    """Become `uid`/`gid` with no supplementary groups (when given: the server is root), then
    hold no capability at all (in a user namespace the caller's uid stays, its powers there go)
    and never gain one again (no_new_privs: a setuid binary runs without its bit)."""
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    header = _CapHeader(CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def apply_limits(limits: Mapping[str, int]) -> None:
    """The call's rlimits (`SandboxLimits`' fields): CPU time (SIGXCPU, then SIGKILL a second
    later), address space, processes of its user, file size, open files, and no core dumps."""
    cpu = int(limits["cpu_seconds"])
    for which, soft, hard in (
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
        (resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"]),
        (resource.RLIMIT_FSIZE, limits["max_file_bytes"], limits["max_file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["max_open_files"], limits["max_open_files"]),
        (resource.RLIMIT_CORE, 0, 0),
    ):
        resource.setrlimit(which, (int(soft), int(hard)))
