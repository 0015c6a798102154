"""Math rewards checked with math-verify (`tidal.engines.math_rewards`)."""

from __future__ import annotations

import threading

import pytest

from tidal.engines.math_rewards import FORMAT_SCORE, final_answer, math_answer, math_format, math_with_format, reference_answer
from tidal.engines.rewards import score
from tidal.flow.trajectory import Trajectory

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 1,272"


def finished(answer, finish_reason="stop"):
    return Trajectory(prompt_ids=[1], finish_reason=finish_reason, meta={"answer": answer})


@pytest.mark.parametrize(
    ("answer", "reference"),
    [(GSM8K_ANSWER, "1272"), ("#### 42", "42"), ("42", "42"), (" \\frac{1}{2} ", "\\frac{1}{2}"), (7, "7"), ("#### $1,000.", "1000"), ("(1,2)", "(1,2)")],
)
def test_the_reference_is_what_follows_the_last_hashes_without_thousands_commas(answer, reference):
    assert reference_answer(answer) == reference


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("So she sold 1,272 clips.\n#### 1,272", "1272"),
        ("The answer is $\\boxed{1272}$.", "1272"),
        ("**\\boxed{\\frac{1}{2}}**", "\\frac{1}{2}"),
        ("\\[\\boxed{x^{2}+1}\\]", "x^{2}+1"),
        ("#### 5 then \\boxed{6}", "6"),  # the later mark is the final answer
        ("\\boxed{5}\n#### 6", "6"),
        ("#### $18", "18"),
        ("no marked answer: 42", None),
        ("\\boxed{42} but then I kept going", None),
        ("#### 42\nand more reasoning", None),
        ("\\boxed{42", None),
        ("\\boxed{}", None),
        ("####   ", None),
    ],
)
def test_the_final_answer_is_the_last_box_or_hashes_line_with_nothing_after_it(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    "text",
    [
        "48/2 = 24 in May, 48+24 = 72 in all.\n#### 1,272",
        "#### 1272",
        "So the total is \\boxed{1272}.",
        "$\\boxed{1,272}$",
        "\\boxed{1272.0}",
    ],
)
def test_a_right_gsm8k_answer_scores_1(text):
    assert math_answer(finished(GSM8K_ANSWER), text) == 1.0


@pytest.mark.parametrize("text", ["#### 1273", "\\boxed{127}", "The answer is 1272.", "\\boxed{1272} wait, no", ""])
def test_a_wrong_or_unmarked_gsm8k_answer_scores_0(text):
    assert math_answer(finished(GSM8K_ANSWER), text) == 0.0


@pytest.mark.parametrize(
    ("reference", "text"),
    [
        ("\\frac{1}{2}", "\\boxed{0.5}"),
        ("0.5", "\\boxed{\\frac{1}{2}}"),
        ("x^2+1", "\\boxed{1+x^2}"),
        ("2\\sqrt{2}", "so \\boxed{\\sqrt{8}}"),
        ("\\frac{3}{4}", "#### 3/4"),
        ("-7", "\\boxed{-7}"),
    ],
)
def test_answers_are_compared_numerically_and_symbolically(reference, text):
    assert math_answer(finished(reference), text) == 1.0


@pytest.mark.parametrize(("reference", "text"), [("\\frac{1}{2}", "\\boxed{0.25}"), ("x^2+1", "\\boxed{x^2-1}"), ("2\\sqrt{2}", "\\boxed{\\sqrt{2}}")])
def test_unequal_answers_score_0(reference, text):
    assert math_answer(finished(reference), text) == 0.0


def test_a_response_cut_at_the_budget_scores_0_whatever_its_text():
    cut = finished(GSM8K_ANSWER, finish_reason="length")
    assert math_answer(cut, "#### 1272") == math_format(cut, "#### 1272") == math_with_format(cut, "#### 1272") == 0.0


def test_the_format_reward_asks_for_a_parsable_final_answer_not_a_right_one():
    trajectory = finished(GSM8K_ANSWER)
    assert math_format(trajectory, "#### 5") == 1.0
    assert math_format(trajectory, "reasoning...\n\\boxed{\\frac{1}{3}}") == 1.0
    assert math_format(trajectory, "5") == 0.0
    assert math_format(trajectory, "#### 5\nmore") == 0.0
    assert math_format(trajectory, "\\boxed{??}") == 0.0


def test_the_shaped_reward_pays_a_little_for_form_and_all_for_the_answer():
    trajectory = finished(GSM8K_ANSWER)
    assert math_with_format(trajectory, "#### 1,272") == 1.0
    assert math_with_format(trajectory, "#### 9") == FORMAT_SCORE
    assert math_with_format(trajectory, "9") == 0.0


def test_an_empty_reference_fails_the_row_in_score():
    rewards, failed = score(math_answer, [finished("#### "), finished("#### 4")], ["\\boxed{1}", "#### 4"])
    assert rewards == [0.0, 1.0] and failed == [0]


def test_an_answer_that_is_no_expression_is_compared_as_text():
    assert math_answer(finished("?!"), "\\boxed{?!}") == 1.0
    assert math_answer(finished("?!"), "\\boxed{!?}") == 0.0


def test_it_runs_off_the_main_thread():
    """math-verify's signal-based timeout works only in the main thread; elsewhere the rewards run without it."""
    out = []
    thread = threading.Thread(target=lambda: out.append(math_answer(finished(GSM8K_ANSWER), "\\boxed{1272}")))
    thread.start()
    thread.join(60)
    assert out == [1.0]


def test_the_math_rewards_are_registered_by_name():
    from tidal.engines.math_rewards import MATH_REWARDS
    from tidal.engines.rewards import MODULE_REWARDS, resolve_reward

    assert set(MODULE_REWARDS) == set(MATH_REWARDS)
    assert all(resolve_reward(name) is fn for name, fn in MATH_REWARDS.items())
