# Copyright (c) zeromib.gpu contributors
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""A real CUDA process for the real-GPU acceptance run: allocates MiB on a GPU with PyTorch,
then waits. Like a training process or an inference server's worker.

  cuda_holder.py --gpu 0 --mib 40960 [--ignore-term] [--fork-child] [--name NAME] --ready FILE

--ignore-term: SIGTERM set to SIG_IGN (bit 15 of SigIgn in /proc/PID/status). The ready file holds
the PID as the caller's /proc numbers it (also when started under `unshare --pid --fork`).

--fork-child: after CUDA init, fork a child that inherits the device files and outlives the
parent (the orphan of tests/gpu/results/README.md, "Measured on a real H200"). --name: pose as another program (kernel comm and argv[0]).
--no-context: open the device files only, no CUDA context (like nvidia-persistenced).
--nvml-loop: no CUDA at all: an NVML client reading every GPU's memory once a second through
pynvml (nvidia-ml-py), as a metrics exporter does.
--zombie-leader: the CUDA context is made by a worker thread; once it holds the memory the main
thread ends itself alone (SYS_exit, as pthread_exit does), leaving the thread-group leader a zombie
(`Zl <defunct>` in ps) whose live thread still holds the GPU (issue 57).
--shm-workers N: also start N multiprocessing workers that share tensors through /dev/shm files
(torch's `file_system` sharing strategy, as DataLoader workers do), kept open, as a training job's
DataLoader leaves them when it is killed (issue 58).
--jax: a JAX process instead of PyTorch: JAX preallocates (XLA_PYTHON_CLIENT_PREALLOCATE, 75 %
of each GPU's memory by default) on EVERY visible GPU, then holds one array on each (--mib ignored).
"""
import argparse
import ctypes
import os
import signal
import sys
import time


def set_comm(name):
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--fork-child", action="store_true")
    parser.add_argument("--no-context", action="store_true")
    parser.add_argument("--nvml-loop", action="store_true")
    parser.add_argument("--jax", action="store_true")
    parser.add_argument("--zombie-leader", action="store_true")
    parser.add_argument("--shm-workers", type=int, default=0)
    parser.add_argument("--name")
    parser.add_argument("--ready", required=True)
    args = parser.parse_args()
    with open("/proc/self/cmdline") as handle:
        argv0 = handle.read().split("\0")[0]
    if args.name and argv0 != args.name:
        # Re-exec so that /proc/PID/cmdline starts with the posed name.
        # With argv[0] not a path Python cannot find its venv (pyvenv.cfg) again: its sys.path goes along.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        os.execve(sys.executable, [args.name, os.path.abspath(__file__)] + sys.argv[1:], env)
    if args.name:
        set_comm(args.name)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep = []
    if args.nvml_loop:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        with open(args.ready + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.rename(args.ready + ".tmp", args.ready)
        while True:
            for device in handles:
                pynvml.nvmlDeviceGetMemoryInfo(device)
            time.sleep(1)
    if args.jax:
        import jax
        import jax.numpy as jnp

        keep.extend(jax.device_put(jnp.ones(1024), device).block_until_ready() for device in jax.devices())
    elif args.no_context:
        for path in ("/dev/nvidiactl", f"/dev/nvidia{args.gpu}", "/dev/nvidia-uvm"):
            try:
                keep.append(os.open(path, os.O_RDWR))
            except OSError:
                keep.append(os.open(path, os.O_RDONLY))
    elif args.zombie_leader:
        zombie_leader(args)
    else:
        import torch

        # As a training process does (torchrun's LOCAL_RANK): without it, PyTorch also makes a
        # ~520 MiB context on GPU 0 for a tensor on another GPU, and nvidia-smi lists the process there.
        torch.cuda.set_device(args.gpu)
        keep.append(torch.empty(args.mib << 20, dtype=torch.uint8, device=f"cuda:{args.gpu}"))
        torch.cuda.synchronize()
    if args.shm_workers:
        keep.append(shm_workers(args.shm_workers))
    child = None
    if args.fork_child:
        child = os.fork()
        if child == 0:
            os.setsid()
            with open(args.ready + ".child", "w") as handle:
                handle.write(str(os.getpid()))
            while True:
                time.sleep(3600)
    with open(args.ready + ".tmp", "w") as handle:
        handle.write(str(pid_seen_from_proc()))
    os.rename(args.ready + ".tmp", args.ready)
    while True:
        time.sleep(3600)


def zombie_leader(args):
    """Allocate in a worker thread, then end the main thread alone: the leader reads Z, its fd
    and maps read empty, the worker keeps the context (the real reading of issue 57)."""
    import threading

    import torch

    held = threading.Event()

    def worker():
        torch.cuda.set_device(args.gpu)
        tensor = torch.empty(args.mib << 20, dtype=torch.uint8, device=f"cuda:{args.gpu}")
        torch.cuda.synchronize()
        held.set()
        while tensor is not None:
            time.sleep(3600)

    threading.Thread(target=worker, daemon=False).start()
    held.wait()
    with open(args.ready + ".tmp", "w") as handle:
        handle.write(str(pid_seen_from_proc()))
    os.rename(args.ready + ".tmp", args.ready)
    ctypes.CDLL(None, use_errno=True).syscall(60, 0)  # SYS_exit (x86-64): this thread only


def shm_workers(count):
    """Workers that get tensors through /dev/shm files (file_system strategy) and keep them."""
    import torch
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    queue = mp.get_context("fork").Queue()
    workers = [mp.get_context("fork").Process(target=_shm_worker, args=(queue,), daemon=False) for _number in range(count)]
    for worker in workers:
        worker.start()
    tensors = [torch.ones(8 << 20, dtype=torch.uint8).share_memory_() for _number in range(count * 2)]
    for tensor in tensors:
        queue.put(tensor)
    return workers, tensors, queue


def _shm_worker(queue):
    kept = [queue.get() for _number in range(2)]
    while kept:
        time.sleep(3600)


def pid_seen_from_proc():
    """This process's PID as the mounted /proc (the caller's namespace) numbers it: under
    `unshare --pid --fork` os.getpid() says 1, /proc/self the PID the caller can signal."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


if __name__ == "__main__":
    main()
