"""benchmarks/stop_drift.py's reading of a greedy answer: correct by the demo's last-number rule, and
whether it ended right after its answer (the collapse it measures is an answer that goes on)."""

from benchmarks.stop_drift import judge


def test_an_answer_that_ends_after_its_number_is_ended_and_scored_by_its_last_number():
    assert judge("3 + 17 = 20<|im_end|>", 20) == (True, True)
    assert judge("20<|im_end|>", 20) == (True, True)
    assert judge("3 + 17 = 21<|im_end|>", 20) == (False, True)


def test_an_answer_that_goes_on_is_not_ended_and_its_second_guess_is_what_scores():
    assert judge("3 + 17 = 20\n\nThe answer is 22.<|im_end|>", 20) == (False, False)
    assert judge("3 + 17 = 21\n\nThe answer is 20.<|im_end|>", 20) == (True, False)
    assert judge("7 + 7 = 14, 7 + 7 = 14, 7 + 7", 14) == (False, False)  # cut at the token limit
    assert judge("The answer is", 14) == (False, False)
