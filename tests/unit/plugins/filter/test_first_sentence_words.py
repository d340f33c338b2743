"""The pure wording of issue 32: a module that did not start, a type mistake, role variables in the role's words."""
from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_spec import plain_errors
from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import in_role_words
from ansible_collections.zeromib.gpu.plugins.plugin_utils._verdict import start_failure, verdict

DESERIALIZATION = "Module result deserialization failed: No start of json char found"


def test_no_sudo_is_said_with_the_shells_words_and_the_fix():
    result = {"failed": True, "msg": DESERIALIZATION, "module_stderr": "/bin/sh: 1: sudo: not found\n", "module_stdout": "", "rc": 127}
    said = start_failure(result)
    assert said is not None and said.startswith("the module could not start on this host: /bin/sh: 1: sudo: not found (rc 127); sudo is not")
    assert verdict(result).problems == [said]


def test_a_missing_python_names_ansible_python_interpreter():
    said = start_failure({"failed": True, "msg": DESERIALIZATION, "module_stderr": "pyenv: python3.13: command not found\n", "rc": 127})
    assert said is not None and "pyenv: python3.13: command not found (rc 127)" in said and "ansible_python_interpreter" in said


def test_sudo_saying_the_python_is_missing_is_a_missing_python_not_a_missing_sudo():
    said = start_failure({"failed": True, "msg": DESERIALIZATION, "module_stderr": "sudo: /usr/bin/python3: command not found\n", "rc": 1})
    assert said is not None and "ansible_python_interpreter" in said and "sudo is not installed" not in said


def test_sshs_closed_connection_line_is_skipped_and_a_traceback_says_its_exception():
    said = start_failure({"failed": True, "msg": DESERIALIZATION, "module_stderr": "Shared connection to gpu-07 closed.\n",
                          "module_stdout": "/bin/sh: 1: sudo: not found\n", "rc": 127})
    assert said is not None and said.startswith("the module could not start on this host: /bin/sh: 1: sudo: not found (rc 127)")
    crashed = start_failure({"failed": True, "msg": DESERIALIZATION, "rc": 1,
                             "module_stderr": 'Traceback (most recent call last):\n  File "x", line 1\nMemoryError: out of memory\n'})
    assert crashed is not None and "MemoryError: out of memory (rc 1)" in crashed


def test_a_module_that_gave_its_own_message_keeps_it():
    assert start_failure({"failed": True, "msg": "nvidia-smi timed out after 10 s"}) is None
    assert verdict({"failed": True, "msg": "nvidia-smi timed out after 10 s"}).problems == ["nvidia-smi timed out after 10 s"]


def test_a_type_mistake_is_one_line_with_the_variable_the_type_and_the_value():
    messages = ["argument 'free_gpus_wait_timeout' is of type str and we were unable to convert to float: "
                "<class 'ansible.module_utils._internal._datatag._AnsibleTaggedStr'> cannot be converted to a float",
                "Elements value for option 'free_gpus_gpus' is of type str and we were unable to convert to int: \"'a'\" cannot be converted",
                "value of free_gpus_service_state must be one of: stopped, disabled, got: stoped"]
    assert plain_errors(messages, {"free_gpus_wait_timeout": "2m", "free_gpus_gpus": ["a"]}) == [
        "free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'",
        'each entry of free_gpus_gpus must be a whole number, got ["a"]',
        "value of free_gpus_service_state must be one of: stopped, disabled, got: stoped"]


def test_the_roles_messages_name_role_variables():
    # issue 55: with a margin over the exact reading (as docs and the audit say), not the reading itself
    said = in_role_words("this is its idle baseline, not a leak; set max_used_mib: 64 (its 55 MiB reading with a margin; "
                         "role: free_gpus_max_used_mib, per host or group) to accept it")
    assert said == ("this is its idle baseline, not a leak; set free_gpus_max_used_mib: 64 (its 55 MiB reading with a margin; "
                    "per host or group) to accept it")
    assert in_role_words("or set kill_spanning: true (role: free_gpus_kill_spanning) to end them") == "or set free_gpus_kill_spanning: true to end them"
    assert in_role_words("GPUs are held by processes that kill=false leaves running") == \
        "GPUs are held by processes that free_gpus_kill: false leaves running"
    assert in_role_words("services: vlm.service matches no unit on this host") == "free_gpus_services: vlm.service matches no unit on this host"
    # plain English is left alone, and a role variable is not renamed twice
    assert in_role_words("killed 2 processes; free_gpus_max_used_mib is 0") == "killed 2 processes; free_gpus_max_used_mib is 0"


def test_ansible_core_2_17s_wording_of_a_type_mistake_is_said_the_same_way():
    # 2.17 and 2.18 name the type given as a class (seen on the fleet with the compat venv: issue 55)
    messages = ["argument 'free_gpus_wait_timeout' is of type <class 'str'> and we were unable to convert to float: "
                "<class 'str'> cannot be converted to a float"]
    assert plain_errors(messages, {"free_gpus_wait_timeout": "2m"}) == ["free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"]


def test_an_idle_baselines_advice_has_a_margin():
    from ansible_collections.zeromib.gpu.plugins.module_utils._options import baseline_with_margin
    assert [baseline_with_margin(mib) for mib in (4, 50, 55, 59, 60, 61, 120)] == [16, 64, 64, 64, 64, 80, 128]
