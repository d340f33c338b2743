"""What a clean gate costs a node (issue 36), through real Ansible on a simulated host.

gpu_release imports what only a host with something to free needs (containers, units,
supervisord, MPS, the respawn watch, the restore record, the smoke test) inside the functions
that use it. Ansible builds the AnsiballZ payload from the imports it finds anywhere in the
source: the payload must still carry every one of them (a missing one would fail only on the
dirty host that needs it), and a clean host must load none of them.
"""
import base64
import glob
import io
import os
import re
import zipfile

from ansible_in_ns import COLLECTIONS, VENV_BIN

PREFIX = "ansible_collections/zeromib/gpu/plugins/module_utils/"
# Loaded only where something is to be freed (or asked for): never on a clean host.
LAZY = ("_containers", "_engines", "_mps", "_settle", "_supervisor", "_units", "_cuda_smoke")


def kept_payload(host, module="gpu_release", args=""):
    """Run zeromib.gpu.<module> once with the payload kept -> the AnsiballZ file's path."""
    remote_tmp = os.path.join(host.dir, "remote-tmp")
    env = {"ANSIBLE_COLLECTIONS_PATH": COLLECTIONS, "HOME": "/root", "ANSIBLE_KEEP_REMOTE_FILES": "1",
           "ANSIBLE_REMOTE_TMP": remote_tmp, "ANSIBLE_LOCALHOST_WARNING": "False"}
    argv = [os.path.join(VENV_BIN, "ansible"), "localhost", "-c", "local", "-m", "zeromib.gpu." + module,
            "-e", "ansible_python_interpreter=/usr/bin/python3"] + (["-a", args] if args else [])
    proc = host.run(argv, env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    found = glob.glob(os.path.join(remote_tmp, "*", f"AnsiballZ_{module}.py"))
    assert len(found) == 1, found
    return found[0]


def payload_zip(path):
    """The zip inside an AnsiballZ wrapper (its base64 `zip_data` literal) -> zipfile.ZipFile."""
    with open(path) as handle:
        text = handle.read()
    match = re.search(r"^zip_data\s*=\s*'([A-Za-z0-9+/=]+)'", text, re.MULTILINE)
    assert match, "no zip_data in the payload"
    return zipfile.ZipFile(io.BytesIO(base64.b64decode(match.group(1))))


# Runs the payload as python3 would, and at exit writes (fd 2) the module_utils in sys.modules.
# Not `-X importtime`: it times only import statements, and gpu_release loads its freeing code
# with importlib.import_module (_release.load_freeing_code).
SHOW_LOADED = (
    "import atexit, os, runpy, sys\n"
    "atexit.register(lambda: os.write(2, ('LOADED ' + ' '.join(sorted(m for m in sys.modules if '.module_utils._' in m)) + '\\n').encode()))\n"
    "sys.argv = [sys.argv[1]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def loaded(host, payload):
    """Our module_utils that running the payload loads (sys.modules at its exit)."""
    proc = host.run(["/usr/bin/python3", "-c", SHOW_LOADED, payload], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("LOADED ")]
    return set(re.findall(r"ansible_collections\.zeromib\.gpu\.plugins\.module_utils\.(\w+)", line)), proc.stdout


def test_clean_gate_payload_carries_every_module_util_but_a_clean_host_loads_none_of_the_freeing_ones(nshost):
    host = nshost("h200x8")
    payload = kept_payload(host)
    packed = {name[len(PREFIX):-3] for name in payload_zip(payload).namelist() if name.startswith(PREFIX)}
    assert set(LAZY) | {"_record", "_signals", "_health", "_facts", "_release"} <= packed
    names, stdout = loaded(host, payload)
    assert '"released": true' in stdout
    assert names & set(LAZY) == set(), names
    assert {"_release", "_facts", "_health", "_nvidia_smi"} <= names


def test_a_dirty_host_loads_what_it_needs_from_the_same_payload(nshost):
    host = nshost("h200x2")
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    payload = kept_payload(host, args="kill_timeout=2")
    assert host.wait_gone(holder.pid, 5)
    holder = host.spawn(["gpu_holder", "--gpus", "0", "--mib", "2048"])
    names, stdout = loaded(host, payload)
    assert '"released": true' in stdout and f'"pid": {holder.pid}' in stdout
    assert host.wait_gone(holder.pid, 5)
    assert {"_containers", "_units", "_settle"} <= names
