"""The training-ready profile (pure logic): each setting an inference side leaves behind is one
sentence naming what it reads, what the profile expects and the command that sets it back; a
reading the GPU does not give is no issue; a skipped setting is never checked; a field the driver
rejects leaves its check unchecked. Through nvidia-smi's own parser, from the H200 capture's words."""
import pytest

from ansible_collections.zeromib.gpu.plugins.module_utils._look import _health as health
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _nvidia_smi as smi
from ansible_collections.zeromib.gpu.plugins.module_utils._look import _readiness as ready

FIELDS = smi.GPU_FIELDS[:2] + smi.READY_FIELDS
# An idle H200: compute mode and power limits as its nvidia-smi -q reads them (580.159.04), application
# clocks as the 590 capture prints them on Hopper.
IDLE = {"index": "0", "uuid": "GPU-22d6f351-b711-b43e-634b-50b970b6a61e", "compute_mode": "Default", "power.limit": "700.00",
        "power.default_limit": "700.00", "clocks.applications.graphics": "[Requested functionality has been deprecated]",
        "clocks.default_applications.graphics": "[Requested functionality has been deprecated]",
        "clocks.applications.memory": "[Requested functionality has been deprecated]",
        "clocks.default_applications.memory": "[Requested functionality has been deprecated]",
        "clocks_event_reasons.applications_clocks_setting": "Not Active", "ecc.mode.current": "Enabled", "ecc.mode.pending": "Enabled"}


def gpu(**changed):
    values = dict(IDLE, **{k.replace("__", "."): v for k, v in changed.items()})
    return smi.parse_gpus(", ".join(values[f] for f, _k, _t in FIELDS), FIELDS)[0]


def row(values):
    merged = dict(IDLE, **values)
    return smi.parse_gpus(", ".join(merged[f] for f, _k, _t in FIELDS), FIELDS)[0]


def test_an_idle_h200_is_ready_by_the_default_profile():
    assert ready.issues(gpu(), ready.Profile()) == []


@pytest.mark.parametrize("values,words", [
    ({"compute_mode": "Exclusive_Process"},
     ["compute mode is Exclusive_Process, expected Default", "all CUDA-capable devices are busy", "nvidia-smi -i 0 -c DEFAULT"]),
    ({"compute_mode": "Prohibited"}, ["compute mode is Prohibited, expected Default"]),
    ({"power.limit": "300.00"}, ["power limit is 300 W, below the default 700 W", "nvidia-smi -i 0 -pl 700"]),
    ({"clocks.applications.graphics": "1410", "clocks.default_applications.graphics": "1980",
      "clocks.applications.memory": "1593", "clocks.default_applications.memory": "1593"},
     ["application clocks (graphics) are 1410 MHz, the default is 1980 MHz", "-rac"]),
    ({"clocks_event_reasons.applications_clocks_setting": "Active"}, ["clocks are held down by a user setting", "-rgc -rmc"]),
    ({"ecc.mode.pending": "Disabled"}, ["an ECC mode change to Disabled is pending"]),
], ids=["exclusive_process", "prohibited", "power_limit_low", "application_clocks", "clocks_locked", "ecc_pending"])
def test_each_setting_off_the_profile_is_one_sentence(values, words):
    issues = ready.issues(row(values), ready.Profile())
    assert len(issues) == 1, issues
    for word in words:
        assert word in issues[0], issues


def test_a_power_limit_above_the_default_and_rounding_are_no_issue():
    assert ready.issues(row({"power.limit": "699.50"}), ready.Profile()) == []
    assert ready.issues(row({"power.limit": "[N/A]", "power.default_limit": "[N/A]"}), ready.Profile()) == []


def test_each_setting_can_be_overridden_or_skipped():
    exclusive = row({"compute_mode": "Exclusive_Process", "power.limit": "450.00", "clocks_event_reasons.applications_clocks_setting": "Active"})
    assert len(ready.issues(exclusive, ready.Profile())) == 3
    profile = ready.Profile.from_params({"compute_mode": "exclusive_process", "clocks": "any", "power_limit": "400"})
    assert ready.issues(exclusive, profile) == []
    stricter = ready.Profile.from_params({"compute_mode": "any", "clocks": "any", "power_limit": "500"})
    assert ready.issues(exclusive, stricter) == ["power limit is 450 W, below the 500 W of ready_profile.power_limit"]
    skip_all = ready.Profile.from_params({"compute_mode": "any", "clocks": "any", "power_limit": "any"})
    assert ready.issues(exclusive, skip_all) == []


def test_not_given_keys_keep_their_defaults():
    profile = ready.Profile.from_params({"power_limit": "any", "compute_mode": None})
    assert profile.record() == {"compute_mode": "default", "clocks": "default", "power_limit": "any"}
    assert ready.Profile.from_params(None).record() == ready.DEFAULT_PROFILE


@pytest.mark.parametrize("given,words", [
    ("default", "ready_profile must be a mapping"),
    ({"compute_mod": "default"}, "unknown key 'compute_mod'"),
    ({"compute_mode": "exclusive"}, "ready_profile.compute_mode must be one of"),
    ({"clocks": "locked"}, "ready_profile.clocks must be default or any"),
    ({"power_limit": "-5"}, "ready_profile.power_limit must be default, any or the least watts"),
    ({"power_limit": "nan"}, "ready_profile.power_limit must be default, any or the least watts"),
    ({"power_limit": True}, "ready_profile.power_limit must be default, any or a number of watts"),
])
def test_a_wrong_profile_is_one_clear_sentence(given, words):
    problems = ready.profile_problems(given)
    assert len(problems) == 1 and words in problems[0], problems
    with pytest.raises(ValueError, match="ready_profile"):
        ready.Profile.from_params(given)


def test_the_health_verdict_carries_the_profile_and_its_readings():
    record = row({"compute_mode": "Exclusive_Process"})
    checks = health.Checks()
    [annotated] = health.Health(checks).annotate([record])
    assert annotated["healthy"] is False
    assert annotated["health_issues"][0].startswith("compute mode is Exclusive_Process, expected Default")
    assert annotated["health"]["ready"]["compute_mode"] == "Exclusive_Process"
    assert annotated["health"]["ready"]["profile"] == ready.DEFAULT_PROFILE
    skipped = health.Checks(ready_profile=ready.Profile(compute_mode="any"))
    assert health.gpu_issues(record, skipped) == []


def test_a_driver_that_rejects_a_field_leaves_that_check_unchecked_unless_skipped():
    record = dict(row({}), compute_mode=None, _rejected=["compute_mode"])
    assert ready.unchecked(record, ready.Profile(), health.FIELD_OF) == [("compute_mode", "the driver does not know compute_mode")]
    assert ready.unchecked(record, ready.Profile(compute_mode="any"), health.FIELD_OF) == []
    assert "compute_mode" in [name for name, _why in health.unchecked_checks(record, health.Checks())]
