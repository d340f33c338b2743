"""The play-wide check of the free_gpus role's variables (plugin_utils/_play_settings.py): one
host's raw variables -> its mistakes in the gate's words; the line of a host another host's mistake
stopped; the answer computed once per play for every gate's fork. Fleet tests run it through
ansible-playbook (tests/fleet/test_typos.py)."""
from __future__ import annotations

import multiprocessing
import os

from ansible_collections.zeromib.gpu.plugins.plugin_utils import _play_settings as ps
from ansible_collections.zeromib.gpu.plugins.plugin_utils._role_vars import role_options

ROLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "roles", "free_gpus")
SPEC = role_options(ROLE) or {}


def mistakes_of(settings):
    return ps.play_mistakes({"h2": settings}, SPEC, frozenset(["free_gpus_result"])).get("h2", [])


def test_a_wrong_type_a_typo_and_a_range_are_said_in_the_gates_words():
    assert mistakes_of({"free_gpus_wait_timeout": "2m"}) == ["free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"]
    assert mistakes_of({"free_gpus_servic_state": "disabled"}) == [
        "free_gpus_servic_state is not a variable of the zeromib.gpu.free_gpus role; did you mean free_gpus_service_state?"]
    assert mistakes_of({"free_gpus_wait_timeout": "nan"}) == ["free_gpus_wait_timeout must be a finite number, got nan"]


def test_good_values_templates_and_the_roles_own_fact_are_no_mistake():
    assert mistakes_of({"free_gpus_wait_timeout": 120, "free_gpus_services": ["vllm*.service"], "free_gpus_result": {"ok": True}}) == []
    # a template's value is its own host's gate to judge, once templated
    assert mistakes_of({"free_gpus_wait_timeout": "{{ my_timeout }}", "free_gpus_gpus": ["{{ gpu }}"]}) == []
    assert ps.templated({"a": ["x", "{% if y %}"]}) and not ps.templated({"a": ["x", 1]})


def test_a_stopped_host_names_the_offending_hosts_and_variables_first():
    one = ps.elsewhere_message({"h2": ["free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"]})
    assert one == "settings mistake on h2 (free_gpus_wait_timeout), nothing was done on any host of the play; its line says what to fix"
    many = ps.elsewhere_message({f"h{i}": ["free_gpus_kil_timeout is not a variable of the zeromib.gpu.free_gpus role; did you mean "
                                           "free_gpus_kill_timeout?"] for i in range(2, 10)})
    assert many.startswith("settings mistake on h2, h3, h4, h5, h6 and 3 more (free_gpus_kil_timeout), nothing was done"), many
    assert many.endswith("their lines say what to fix")


def _ask(folder: str, key: str, calls: str) -> None:
    def compute():
        with open(calls, "a", encoding="utf-8") as handle:
            handle.write("x")
        return {"h2": ["free_gpus_x is not a variable"]}
    assert ps.once(folder, key, compute) == {"h2": ["free_gpus_x is not a variable"]}


def test_the_answer_is_computed_once_for_every_fork_of_the_run(tmp_path):
    calls = tmp_path / "calls"
    forks = [multiprocessing.get_context("fork").Process(target=_ask, args=(str(tmp_path), "k1", str(calls))) for _fork in range(6)]
    for fork in forks:
        fork.start()
    for fork in forks:
        fork.join(30)
        assert fork.exitcode == 0
    assert calls.read_text() == "x"
    # another play (key): asked again
    _ask(str(tmp_path), "k2", str(calls))
    assert calls.read_text() == "xx"


def test_without_a_folder_to_write_it_is_computed_here(tmp_path):
    assert ps.once(str(tmp_path / "missing"), "k", lambda: {}) == {}


def test_hosts_with_the_same_settings_are_judged_once_and_each_is_told_its_own(monkeypatch):
    judged = []
    real = ps.mistakes

    def counted(values, spec, not_options=()):
        judged.append(dict(values))
        return real(values, spec, not_options)

    monkeypatch.setattr(ps, "mistakes", counted)
    fleet = {f"h{n}": {"free_gpus_wait_timeout": "2m", "free_gpus_kill": True} for n in range(1, 31)}
    # The same value of another type, and a host of its own, are judged apart.
    fleet["h31"] = {"free_gpus_wait_timeout": 120, "free_gpus_kill": True}
    fleet["h32"] = {"free_gpus_wait_timeout": "2m", "free_gpus_kill": 1}
    found = ps.play_mistakes(fleet, SPEC)
    assert len(judged) == 3
    assert set(found) == {f"h{n}" for n in range(1, 31)} | {"h32"}
    assert found["h1"] == found["h30"] and found["h1"] is not found["h30"]
    assert found["h1"][0].startswith("free_gpus_wait_timeout must be a number of seconds")
    assert "h31" not in found


def test_the_key_tells_apart_values_that_print_alike():
    key = ps.same_settings_key
    assert key({"free_gpus_kill": True}) != key({"free_gpus_kill": 1}) != key({"free_gpus_kill": "1"})
    assert key({"free_gpus_timeout": 1.0}) != key({"free_gpus_timeout": 1})
    assert key({"free_gpus_gpus": ["0"]}) != key({"free_gpus_gpus": [0]}) != key({"free_gpus_gpus": ("0",)})
    assert key({"a": 1, "b": 2}) == key({"b": 2, "a": 1})
