"""benchmarks/demo.py's verdict on whether learning held: a run holds when it ends within HOLD of the best
test accuracy it showed, periodic or final."""

from benchmarks.demo import HOLD, held, holding


def _run(curve, after, kept=None):
    return {"curve": curve, "accuracy_after": after, "best_kept": kept}


def test_a_run_holds_when_it_ends_near_its_best():
    assert held(_run([0.5, 0.8, 0.78], 0.8 - HOLD + 1e-9))
    assert not held(_run([0.5, 0.8, 0.78], 0.8 - HOLD - 0.01))
    assert held(_run([0.5, 0.6], 0.9))  # the final is the best
    assert held(_run([], 0.4))


def test_the_table_counts_held_runs_and_medians():
    runs = [_run([0.5, 0.8], 0.79, {"test_accuracy": 0.8}), _run([0.7, 0.77], 0.5, {"test_accuracy": 0.77}),
            _run([0.6], 0.7)]
    row = holding(runs)[2]
    assert row.startswith("| 2 of 3 | 0.7 (0.5-0.79) | 0.77 (0.7-0.8) | 0.785 (0.77-0.8) |"), row
