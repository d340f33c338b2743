"""A user whose live service keeps shared memory in /dev/shm that others attach to (issue 65).

Her data service creates a named block with Python's multiprocessing.shared_memory, writes it, and
closes its handle without unlinking it, as Python documents for a block other processes attach to
by name: the file /dev/shm/psm_<8 hex> stays, and no process has it open or mapped, yet it is
live data (the service and its resource tracker run on, and the next reader opens it by name).
She also runs a CUDA job on a GPU of her own, which a release of other GPUs never selects.

    with shm_user(host, uid=4343, gpu=1) as user:
        ...                                # gpu_release of GPU 0 with clean_shm
        assert attach(host, user)          # her reader still finds the block

Everything runs inside the namespace host given (tests/sim/nshost.py) as the unprivileged uid
(setpriv, as NsHost.spawn_as does), never on this machine's process table, and is ended by PID
when the block ends (the host's teardown ends whatever is left)."""
import contextlib
import typing as t

SERVICE = r"""
import json, os, sys, time
from multiprocessing import shared_memory
block = shared_memory.SharedMemory(create=True, size=1 << 20)
block.buf[:] = b"\1" * (1 << 20)  # the data it serves: 1 MiB of pages written
block.buf[:9] = b"live data"
name = block.name
block.close()  # the handle closed, the block left for readers to attach to by name
ready = sys.argv[sys.argv.index("--ready-file") + 1]
with open(ready + ".tmp", "w") as handle:
    json.dump({"pid": os.getpid(), "block": name, "children": [], "workers": []}, handle)
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
"""

# A reader of the block, as multiprocessing.shared_memory attaches (shm_open: an open of
# /dev/shm/NAME), without its resource tracker (which, before Python 3.13, unlinks a block its
# reader only attached to when that reader exits).
READER = r"""
import mmap, os, sys
fd = os.open("/dev/shm/" + sys.argv[1], os.O_RDWR)
with mmap.mmap(fd, 0) as view:
    print(bytes(view[:9]).decode())
"""


class ShmUser(t.NamedTuple):
    """The tenant as started: her uid, her service (HostProc) and the name of its block in
    /dev/shm, her CUDA job (HostProc, or None) and the GPU it holds."""

    uid: int
    service: t.Any
    block: str
    job: t.Any
    gpu: int


def start(host, uid=4343, gpu=1, mib=1024):
    """Her data service and her CUDA job on GPU `gpu` (None: no job), in `host`, as `uid`. The
    service is ready when its block exists with its handle closed."""
    service = host.spawn_as(uid, ["/usr/bin/python3", "-c", SERVICE], ready=True)
    try:
        job = None if gpu is None else host.spawn_as(uid, ["gpu_holder", "--gpus", str(gpu), "--mib", str(mib)])
    except BaseException:
        host.kill(service.pid)
        raise
    return ShmUser(uid, service, service.info["block"], job, gpu)


def stop(host, user):
    """End her processes by PID (the service's resource tracker, its child, goes with the host)."""
    for proc in (user.job, user.service):
        if proc is not None and host.alive(proc.pid):
            host.kill(proc.pid)


@contextlib.contextmanager
def shm_user(host, uid=4343, gpu=1, mib=1024):
    """start() for the block, stop() after it, also on failure."""
    user = start(host, uid, gpu, mib)
    try:
        yield user
    finally:
        stop(host, user)


def attach(host, user):
    """Whether her next reader finds the block and its data (as her uid): True, or the reader's
    error (FileNotFoundError once the block was removed)."""
    done = host.run(["setpriv", "--reuid", str(user.uid), "--regid", str(user.uid), "--clear-groups", "--",
                     "/usr/bin/python3", "-c", READER, user.block])
    if done.returncode == 0 and done.stdout.strip() == "live data":
        return True
    return (done.stderr.strip().splitlines() or [f"rc {done.returncode}"])[-1]
