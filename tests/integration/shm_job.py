"""A job's shared-memory segments in /dev/shm, as NCCL, PyTorch and Python multiprocessing leave them.

    shm_job.py [open:NAME:MIB | map:NAME:MIB | later:NAME:MIB]... [exec ARGV... | child ARGV...] --ready-file PATH

`{pid}` in a NAME is this process's PID (kept across `exec`), as PyTorch names its segments.
Each `open:` file is created in /dev/shm with MIB written (pages it really takes) and kept open, as
NCCL keeps its nccl-XXXXXX segment's descriptor; each `map:` file is mapped shared and its
descriptor closed, as PyTorch's file_system strategy and sem_open leave theirs (only
/proc/PID/maps shows them). Then it writes {"pid": ...} to the ready file and sleeps, or with
`exec` it becomes ARGV (gpu_holder: a CUDA job), keeping the open files (mappings end at exec) and
handing it the ready file. With `child` it starts ARGV as its child (handing it the ready file),
waits for it to end and only then makes each `later:` file, unheld: a job's segment made while a
run is on, after its look."""
import json
import mmap
import os
import sys
import time

MIB = 1024 * 1024


def create(name, mib):
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    size = max(int(float(mib) * MIB), 4096)
    os.ftruncate(fd, size)
    os.pwrite(fd, b"\1" * size, 0)
    return fd, size


def main(argv):
    ready = argv[argv.index("--ready-file") + 1]
    argv = argv[:argv.index("--ready-file")] + argv[argv.index("--ready-file") + 2:]
    keep = []
    rest = []
    later = []
    mode = None
    for i, item in enumerate(argv):
        if item in ("exec", "child"):
            mode, rest = item, argv[i + 1:]
            break
        how, name, mib = item.split(":")
        name = name.replace("{pid}", str(os.getpid()))  # a framework's name with its maker's PID (torch_<pid>_...)
        if how == "later":
            later.append((name, mib))
            continue
        fd, size = create(name, mib)
        if how == "map":
            keep.append(mmap.mmap(fd, size))
            os.close(fd)
        else:
            os.set_inheritable(fd, True)
            keep.append(fd)
    if mode == "exec":
        os.execv(rest[0], rest + ["--ready-file", ready])
    if mode == "child":
        pid = os.fork()
        if pid == 0:
            try:
                os.execv(rest[0], rest + ["--ready-file", ready])
            finally:
                os._exit(127)
        os.waitpid(pid, 0)
        for name, mib in later:
            os.close(create(name, mib)[0])
        while True:
            time.sleep(3600)
    with open(ready + ".tmp", "w") as handle:
        json.dump({"pid": os.getpid(), "children": [], "workers": []}, handle)
    os.rename(ready + ".tmp", ready)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
