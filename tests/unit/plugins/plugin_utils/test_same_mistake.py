"""A settings mistake of the whole play is said once (issue 67): the first host that has it says it, the others point to it."""
from __future__ import annotations

from ansible_collections.zeromib.gpu.plugins.plugin_utils._outcome import failed, same_mistake_message, same_mistakes
from ansible_collections.zeromib.gpu.plugins.plugin_utils._summary import summary_lines

WRONG = "settings mistake, nothing was done: free_gpus_wait_timeout must be a number of seconds (e.g. 120), got '2m'"


def test_the_first_host_with_a_mistake_says_it_and_the_others_with_the_same_point_to_it():
    outcomes = [failed(f"h{i}", WRONG, "invalid") for i in range(1, 4)] + [failed("h4", WRONG + "; free_gpus_kill_timeout must be", "invalid")]
    assert same_mistakes(outcomes) == {"h2": "h1", "h3": "h1"}
    assert same_mistake_message(outcomes[1], "h1") == ("h2: settings mistake, nothing was done: the same as h1 (free_gpus_wait_timeout), "
                                                       "whose line says it")


def test_a_typo_names_the_variable_not_the_suggestion():
    typo = failed("h2", "settings mistake, nothing was done: free_gpus_sevices is not a variable of the zeromib.gpu.free_gpus role; "
                        "did you mean free_gpus_services?", "invalid")
    assert same_mistake_message(typo, "h1").endswith("the same as h1 (free_gpus_sevices), whose line says it")


def test_other_failures_are_each_said():
    outcomes = [failed("h1", "GPUs still in use", "dirty"), failed("h2", "GPUs still in use", "dirty")]
    assert same_mistakes(outcomes) == {}


def test_the_fleet_summary_says_a_play_wide_mistake_on_one_line():
    lines = summary_lines([failed(f"h{i}", WRONG, "invalid") for i in range(1, 65)])
    assert sum(WRONG.split(": ", 1)[1] in line for line in lines) == 1
    assert sum("the same as h1 (free_gpus_wait_timeout)" in line for line in lines) == 63
