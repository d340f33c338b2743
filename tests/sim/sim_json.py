"""json.load for the simulated tools (nvidia-smi, journalctl/dmesg, Fabric Manager), without json.

Each tool is run thousands of times a suite, and `import json` (which imports re and enum) costs
~10 ms of CPU at every start on the 2-core machine, a third of an nvidia-smi call (issue 34). This
reads through the C scanner json itself uses (`_json.make_scanner`), with json's defaults. Text that
is not JSON (a file half written) goes to json itself, which raises its ValueError as before.

The tools import it from their own directory (Python puts a script's real directory first on
sys.path, also when it runs through a symlink such as /usr/bin/nvidia-smi), in the checkout and in
the copy each fleet host gets. Stdlib only, Python 3.8+.
"""
try:
    from _json import make_scanner
except ImportError:  # a Python without json's C accelerator
    make_scanner = None


class JsonContext:
    """What json's decoder hands its C scanner: json's own defaults."""
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name):
        return float(name.replace("Infinity", "inf"))


def json_load(handle):
    """json.load(handle), as json reads it."""
    if make_scanner is None:
        import json
        return json.load(handle)
    text = handle.read().strip(" \t\n\r")
    try:
        value, end = make_scanner(JsonContext())(text, 0)
    except (StopIteration, ValueError, SystemError):  # _json raises through json.decoder, not imported
        value, end = None, -1
    if end != len(text):
        import json  # not JSON (a file mid write): json.loads raises its ValueError
        return json.loads(text)
    return value
