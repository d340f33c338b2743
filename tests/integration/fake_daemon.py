"""Pose as a GPU daemon (nvidia-persistenced by default): open every /dev/nvidia* node, set the
kernel comm (truncated to 15 characters, as the kernel does) and argv[0], and wait. Holds no
GPU memory, like the real daemon. Usage: fake_daemon.py NAME READY_FILE"""
import ctypes
import glob
import os
import sys
import time

name, ready = sys.argv[1], sys.argv[2]
with open("/proc/self/cmdline") as handle:
    argv0 = handle.read().split("\0")[0]
if argv0 != name:
    os.execv(sys.executable, [name, os.path.abspath(__file__), name, ready])
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
fds = [os.open(path, os.O_RDWR) for path in sorted(glob.glob("/dev/nvidia*")) if not os.path.isdir(path)]
with open(ready + ".tmp", "w") as handle:
    handle.write(str(os.getpid()))
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
