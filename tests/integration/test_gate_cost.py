"""What a clean gate costs a node (issue 36), through real Ansible on a simulated host.

gpu_release keeps the code it compiled in root's bytecode cache on the node (_compile_once): the
next gate loads it instead of compiling, only from root-only entries of the same source.

gpu_release imports what only a host with something to free needs (containers, units,
supervisord, MPS, the respawn watch, the restore record: the freeing room, _act/_freeing; the
smoke test) only where it is needed. Ansible builds the AnsiballZ payload from the imports it finds anywhere in the
source: the payload must still carry every one of them (a missing one would fail only on the
dirty host that needs it), and a clean host must load none of them.
"""
import base64
import glob
import io
import os
import re
import zipfile

from ansible_in_ns import COLLECTIONS, VENV_BIN, run_module

PREFIX = "ansible_collections/zeromib/gpu/plugins/module_utils/"
# Loaded only where something is to be freed (or asked for): never on a clean host.
LAZY = ("_freeing", "_containers", "_engines", "_mps", "_settle", "_supervisor", "_units", "_cuda_smoke", "_guest_units", "_shm_clean",
        "_node_shapes", "_origin", "_apptainer", "_paused", "_vfio")


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
# (earlier releases loaded their freeing code with importlib.import_module; `sys.modules` sees any way).
SHOW_LOADED = (
    "import atexit, os, runpy, sys\n"
    "atexit.register(lambda: os.write(2, ('LOADED ' + ' '.join(sorted(m for m in sys.modules if '.module_utils._' in m)) + '\\n').encode()))\n"
    "sys.argv = [sys.argv[1]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def reported(host, script, payload, tag):
    """Run the payload under `script` -> (the line `script` wrote to fd 2 after `tag`, stdout)."""
    proc = host.run(["/usr/bin/python3", "-c", script, payload], timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith(tag + " ")]
    return line, proc.stdout


def loaded(host, payload, wing=None):
    """Our module_utils that running the payload loads (sys.modules at its exit), by file name;
    with `wing` (_look, _act, _slurm), those of that folder only."""
    line, stdout = reported(host, SHOW_LOADED, payload, "LOADED")
    found = re.findall(r"ansible_collections\.zeromib\.gpu\.plugins\.module_utils\.(?:(_look|_act|_slurm)\.)?(\w+)", line)
    return {name for folder, name in found if wing is None or folder == wing}, stdout


def test_clean_gate_payload_carries_every_module_util_but_a_clean_host_loads_none_of_the_freeing_ones(nshost):
    host = nshost("h200x8")
    payload = kept_payload(host)
    packed = {os.path.basename(name[:-3]) for name in payload_zip(payload).namelist() if name.startswith(PREFIX)}
    assert set(LAZY) | {"_record", "_signals", "_health", "_facts", "_release"} <= packed
    names, stdout = loaded(host, payload)
    assert '"released": true' in stdout
    assert names & set(LAZY) == set(), names
    # The reading wing's bounded reads (_look/_bounded_reads) come with the scan on every host: no
    # read of another process may hang the gate (issue 57). So do the scan's device and mount
    # tables and the protection rules (issue 68: out of _holders, each its own file).
    assert {"_release", "_facts", "_health", "_nvidia_smi", "_holders", "_devices", "_mounts", "_protect", "_bounded_reads"} <= names
    # Of the acting wing, a clean host loads the engine's clean rooms only (issue 68): the run
    # (_release), the plan (_plan), the failure words (_words) and the node's seam (_system, with
    # _signals' pidfds); the freeing room (_act/_freeing) is in the payload, not loaded.
    acting, _stdout = loaded(host, payload, "_act")
    assert acting == {"_release", "_plan", "_words", "_system", "_errors", "_signals"}, acting


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


BYTECODE = "/var/lib/zeromib-gpu/bytecode"
# Runs the payload as python3 would, and at exit writes (fd 2) each of our module_utils compiled.
COUNT_COMPILES = (
    "import atexit, builtins, os, runpy, sys\n"
    "seen = []\n"
    "real = builtins.compile\n"
    "def counted(source, filename, *args, **kwargs):\n"
    "    seen.append(str(filename))\n"
    "    return real(source, filename, *args, **kwargs)\n"
    "builtins.compile = counted\n"
    "atexit.register(lambda: os.write(2, ('COMPILED ' + ' '.join(seen) + '\\n').encode()))\n"
    "sys.argv = [sys.argv[1]]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def compiled(host, payload):
    """Our module_utils that running the payload compiled (their names, sorted); it must release."""
    line, stdout = reported(host, COUNT_COMPILES, payload, "COMPILED")
    assert '"released": true' in stdout, stdout[-2000:]
    names = re.findall(r"/zeromib/gpu/plugins/module_utils/(?:_\w+/)?(_\w+)\.py", line)
    # Compiled before the cache can act: the package and the module_util that installs it.
    return sorted(name for name in names if name not in ("__init__", "_compile_once"))


def kept_entries(host):
    """{entry name: (mode, owner, inode)} of the node's bytecode cache, and the directory's."""
    proc = host.run(["sh", "-c", f"stat -c '%a %U %i %n' {BYTECODE} {BYTECODE}/*"])
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(" ", 3) for line in proc.stdout.splitlines()]
    return {os.path.basename(name): (mode, owner, inode) for mode, owner, inode, name in rows}


def test_a_gate_keeps_what_it_compiled_root_only_and_the_next_gate_compiles_none_of_it(nshost):
    host = nshost("h200x8")
    assert run_module(host, "gpu_release", check=True)["released"] is True
    assert host.run(["test", "-e", BYTECODE]).returncode == 1, "check mode wrote the bytecode cache"
    payload = kept_payload(host)
    entries = kept_entries(host)
    assert entries.pop("bytecode")[:2] == ("700", "root")
    release = [name for name in entries if ".plugins.module_utils._act._release.py.cpython-" in name]
    assert len(release) == 1 and len(entries) >= 10, sorted(entries)
    assert {row[:2] for row in entries.values()} == {("600", "root")}
    # The next gate: nothing of ours compiled, nothing rewritten.
    assert compiled(host, payload) == []
    assert kept_entries(host) == dict(entries, bytecode=kept_entries(host)["bytecode"])
    # A directory others may write is not read (nor written): everything compiled, as without it.
    host.run(["chmod", "0777", BYTECODE], check=True)
    assert {"_release", "_facts", "_health", "_holders", "_devices", "_mounts", "_protect", "_nvidia_smi"} <= set(compiled(host, payload))
    host.run(["chmod", "0700", BYTECODE], check=True)
    # A spoiled entry is compiled from the source and kept again; the others stay as they were.
    host.run(["truncate", "-s", "40", f"{BYTECODE}/{release[0]}"], check=True)
    assert compiled(host, payload) == ["_release"]
    after = kept_entries(host)
    assert after[release[0]][2] != entries[release[0]][2]
    assert {k: v for k, v in after.items() if k not in (release[0], "bytecode")} == {k: v for k, v in entries.items() if k != release[0]}
    assert compiled(host, payload) == []
