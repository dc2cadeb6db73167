"""The verdict rule on hand-made per-seed numbers: t and p against hand computations (with 3 seeds the t
distribution has 2 degrees of freedom, whose two-sided p is 1 - |t| / sqrt(2 + t^2)), the three words, Holm."""

import math

import pytest

from rag_train.reproduction.verdict import BEATS, LEVEL, UNDECIDED, compare, compare_variants, holm, main


def p_two_dof(t: float) -> float:
    return 1 - abs(t) / math.sqrt(2 + t * t)


def test_a_clear_win_beats_with_hand_computed_t_and_p():
    """Differences 5 / 6 / 7: mean 6, sd 1, t = 6 sqrt(3)."""
    v = compare("ContAccum", [45.0, 41.0, 47.0], "GradCache", [40.0, 35.0, 40.0])
    assert v.diffs == (5.0, 6.0, 7.0) and v.n == 3
    assert v.t == pytest.approx(6 * math.sqrt(3)) and v.p == pytest.approx(p_two_dof(6 * math.sqrt(3)))
    assert (v.word, v.winner, v.phrase()) == (BEATS, "ContAccum", "ContAccum beats GradCache")
    assert v.summary().startswith("ContAccum beats GradCache (ContAccum 44.3 ± 3.1 vs GradCache 38.3 ± 2.9, n 3 "
                                  "paired seeds; per-seed differences +5.0 / +6.0 / +7.0; paired t 10.39, p 0.009;")
    assert compare("GradCache", [40.0, 35.0, 40.0], "ContAccum", [45.0, 41.0, 47.0]).winner == "ContAccum"


def test_seed_003s_np_gain_is_undecided():
    """The committed per seed +9.3 / +26.3 / +6.3: t 2.24, p 0.15, the best of 3 variants: Holm 3 p."""
    v = compare("Np BASE", [30.7, 31.0, 32.3], "vanilla", [21.4, 4.7, 26.0], m=3)
    assert v.t == pytest.approx(2.242, abs=1e-3) and v.p == pytest.approx(p_two_dof(v.t))
    assert v.p_adjusted == pytest.approx(3 * v.p) and v.word == UNDECIDED and v.winner is None
    assert "(Holm over 3: 0.462)" in v.summary()


def test_a_tie_is_level_and_identical_rows_are_level():
    a = [50.0, 60.0, 55.0, 52.0, 58.0]
    v = compare("A", a, "B", [x + d for x, d in zip(a, (0.1, -0.1, 0.2, -0.2, 0.0))])
    assert v.word == LEVEL and -1.0 <= v.ci[0] and v.ci[1] <= 1.0 and v.p > 0.05
    same = compare("GradCache", a, "in-batch 16", a)
    assert (same.word, same.t, same.p) == (LEVEL, 0.0, 1.0)
    assert compare("A", a, "B", [x - 0.5 for x in a]).word == BEATS  # a constant shift: no spread, a win


def test_one_outlier_seed_makes_the_mean_look_better_but_is_no_win():
    """Three seeds a point behind, one 30 ahead: the mean is 6.75 ahead, the test does not reject."""
    v = compare("A", [40.0, 41.0, 70.0, 42.0], "B", [41.0, 42.0, 40.0, 43.0])
    assert v.mean_diff == pytest.approx(6.75) and v.p > 0.05
    assert (v.word, v.winner) == (UNDECIDED, None)
    assert v.reason == "not significant, and the interval reaches beyond the tolerance"


def test_holm_by_hand_and_the_family_of_variants():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])  # 3 x 0.01; 2 x 0.03; max(0.06, 0.04)
    assert holm([0.5, 0.5]) == [1.0, 1.0] and holm([]) == []
    base = [10.0, 20.0, 30.0]
    good = [14.0, 25.0, 36.0]  # differences 4 / 5 / 6: t 5 sqrt(3), p 0.013
    p = p_two_dof(5 * math.sqrt(3))
    assert compare("good", good, "base", base).word == BEATS
    assert compare("good", good, "base", base, m=4).p_adjusted == pytest.approx(4 * p)
    assert compare("good", good, "base", base, m=4).word == UNDECIDED  # 4 x 0.013 = 0.052: picking costs
    family = compare_variants("base", base, {"good": good, "noisy": [20.0, 15.0, 31.0], "one seed": [11.0]})
    assert family["good"].p_adjusted == pytest.approx(2 * p) and family["good"].word == BEATS  # 2 tested, one n < 2
    assert family["noisy"].p_adjusted == pytest.approx(max(2 * p, family["noisy"].p))
    assert family["one seed"].word == UNDECIDED and family["one seed"].reason == "fewer than 2 paired seeds (1)"


def test_fewer_than_two_paired_seeds_is_undecided():
    v = compare("A", [90.0], "B", [10.0])
    assert (v.word, v.t, v.p, v.n) == (UNDECIDED, None, None, 1)
    assert v.summary() == ("undecided (A 90.0 vs B 10.0, n 1 paired seeds; per-seed differences +80.0; alpha 0.05, "
                           "tolerance ±1): fewer than 2 paired seeds (1)")
    assert compare("A", [90.0, 80.0, 70.0], "B", [10.0]).n == 1  # the row with one seed pairs its first
    assert compare("A", [], "B", []).summary().startswith("undecided (A - vs B -, n 0 paired seeds;")


def test_the_command_prints_one_line(capsys):
    main(["--a", "ContAccum", "45", "41", "47", "--b", "GradCache", "40", "35", "40"])
    assert capsys.readouterr().out.startswith("ContAccum beats GradCache (ContAccum 44.3 ± 3.1")
    with pytest.raises(SystemExit):
        main(["--a", "A", "x", "--b", "B", "1"])
