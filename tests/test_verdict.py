"""The verdict rule on hand-made per-seed numbers: t and p against hand computations (with 3 seeds the t
distribution has 2 degrees of freedom, whose two-sided p is 1 - |t| / sqrt(2 + t^2)), the three words, Holm."""

import math

import pytest
from scipy import stats

from rag_lab.reproduction.verdict import BEATS, LEVEL, UNDECIDED, compare, compare_variants, holm, main


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
    a, b = [61.2, 62.0, 59.8, 64.1], [62.0, 59.6, 56.4, 60.0]
    reference = stats.ttest_rel(a, b)
    assert (compare("A", a, "B", b).t, compare("A", a, "B", b).p) == pytest.approx((reference.statistic,
                                                                                     reference.pvalue))


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



def test_equal_differences_take_the_sign_test():
    """Differences that do not vary leave the t-test no spread: p is the sign test's 2 x 0.5^n, so a constant shift
    decides from 6 seeds on; below that it is level within the tolerance and undecided beyond it."""
    a = [50.0, 60.0, 55.0, 52.0, 58.0, 61.0]
    six = compare("A", a, "B", [x - 3.0 for x in a])
    assert (six.word, six.winner, six.p) == (BEATS, "A", pytest.approx(2 / 64))
    assert "every difference equal: sign test p 0.031" in six.summary()
    five = compare("A", a[:5], "B", [x - 3.0 for x in a[:5]])
    assert (five.word, five.p, five.ci) == (UNDECIDED, pytest.approx(2 / 32), pytest.approx((3.0, 3.0)))
    assert compare("A", a[:5], "B", [x - 0.5 for x in a[:5]]).word == LEVEL  # within ±1 on every seed
    # -3.7 on each of three seeds, as fractions of 300 questions times 100 (equal but for float rounding): p 0.25
    three = compare("(c)", [0.597 * 100, 0.583 * 100, 0.57 * 100], "SNM", [0.634 * 100, 0.62 * 100, 0.607 * 100])
    assert three.word == UNDECIDED and three.p == pytest.approx(0.25) and math.isinf(three.t)


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
    assert family["good"].p_adjusted == pytest.approx(3 * p) and family["good"].word == BEATS  # 0.039: still a win
    assert family["noisy"].p_adjusted == pytest.approx(max(3 * p, min(1.0, 2 * family["noisy"].p)))
    assert family["one seed"].word == UNDECIDED and family["one seed"].reason == "fewer than 3 paired seeds (1)"


def test_fewer_than_three_paired_seeds_is_undecided():
    """Two seeds give the t-test one degree of freedom: the committed -3.7 / -3.7 of (c) against SNM on world 2
    (equal to the question) decides nothing, and neither does a large gap on two seeds."""
    two = compare("(c)", [59.7, 58.3], "SNM", [63.3, 62.0])
    assert (two.word, two.t, two.reason) == (UNDECIDED, None, "fewer than 3 paired seeds (2)")
    assert compare("A", [90.0, 91.0], "B", [10.0, 12.0]).word == UNDECIDED
    v = compare("A", [90.0], "B", [10.0])
    assert (v.word, v.t, v.p, v.n) == (UNDECIDED, None, None, 1)
    assert v.summary() == ("undecided (A 90.0 vs B 10.0, n 1 paired seeds; per-seed differences +80.0; alpha 0.05, "
                           "tolerance ±1): fewer than 3 paired seeds (1)")
    assert compare("A", [90.0, 80.0, 70.0], "B", [10.0]).n == 1  # the row with one seed pairs its first
    assert compare("A", [], "B", []).summary().startswith("undecided (A - vs B -, n 0 paired seeds;")


def test_the_command_prints_one_line(capsys):
    main(["--a", "ContAccum", "45", "41", "47", "--b", "GradCache", "40", "35", "40"])
    assert capsys.readouterr().out.startswith("ContAccum beats GradCache (ContAccum 44.3 ± 3.1")
    with pytest.raises(SystemExit):
        main(["--a", "A", "x", "--b", "B", "1"])


def test_seed_000s_pair_claims_take_their_word_from_the_rule():
    """Each (better, worse) pair of the paper against 3 seeds made by hand: a clear win in the paper's direction, one
    against it, a tie where the paper is on par, a win where the paper is on par, and noise."""
    from rag_lab.reproduction.comparison import pair_claims

    def runs(*values):
        return [{"r": v} for v in values]

    rows = {"a": runs(0.50, 0.52, 0.55), "b": runs(0.40, 0.41, 0.43), "c": runs(0.30, 0.32, 0.34),
            "d": runs(0.401, 0.409, 0.431), "f": runs(0.60, 0.35, 0.45)}
    paper = {"a": 30.0, "b": 20.0, "c": 25.0, "d": 20.5, "e": 20.3, "f": 25.0}
    rows["e"] = rows["a"]
    lines = pair_claims(rows, paper, [("a", "b"), ("c", "b"), ("d", "b"), ("e", "b"), ("f", "b")], lambda m: m["r"])
    assert [line.split("→ ")[1] for line in lines] == [
        "**reproduces**.", "**does not reproduce**.", "**reproduces (on par)**.",
        "**does not reproduce (paper: on par)**.", "**undecided**."]
    assert lines[0].startswith("- a − b: measured +11.0 points (a ahead on 3/3 seeds; paired t 19.05, p 0.003)")
    unpaired = pair_claims(rows, {}, [("a", "b"), ("d", "b"), ("f", "b")], lambda m: m["r"])  # no paper: the rule
    assert [line.split("→ ")[1] for line in unpaired] == [
        "by the rule **a beats b**.", "by the rule **level**.", "by the rule **undecided**."]


def test_dynnibal_beats_snm_only_by_the_rule():
    """Dynnibal closes 81% of the gap (over half) and its mean is above SNM's, but per seed +14 / +4 / +10 is no
    paired win over 3 seeds (p 0.085): undecided; 14 / 14 / 13 points on every seed: reproduced."""
    from rag_lab.reproduction.dynnibal import gap_lines

    def runs(*r1s, memory=None):
        return [{"recall": {"1": r}, **({"strategy_summary": {"device_memory_pct": memory}} if memory else {})}
                for r in r1s]

    rows = {"uniform": runs(0.40, 0.45, 0.42), "exhaustive": runs(0.70, 0.68, 0.69),
            "dynnibal": runs(0.64, 0.66, 0.62, memory=5.9), "snm": runs(0.50, 0.62, 0.52)}
    claim = gap_lines(rows, 300, {"snm": 18})[-1]
    assert claim.startswith("Seed 001's claim (Dynnibal closes more than half of the gap at a small memory share and "
                            "beats SNM at equal memory): **undecided** here: Dynnibal closes 81% at 5.9% device memory")
    assert "per-seed differences +14.0 / +4.0 / +10.0; paired t 3.21, p 0.085" in claim
    rows["snm"] = runs(0.50, 0.52, 0.49)
    assert "**reproduced** here" in gap_lines(rows, 300, {"snm": 18})[-1]
    rows["snm"] = runs(0.80, 0.82, 0.79)
    assert "**not reproduced** here" in gap_lines(rows, 300, {"snm": 18})[-1]


def test_dynnibal_against_the_equal_cost_controls_by_the_rule():
    """The scheduled Dynnibal 64 / 66 / 62 against four controls, Holm over four: 10 / 11 / 9 above SNM at 10/3x its
    memory (t 17.3, p 0.003 x 4), 10 / 11 / 10 below SNM at 10x: the paper's "above SNM with 3-33x its memory" is not
    reproduced; above both, reproduced; one undecided and one won, undecided. Memory shares by hand: 1,173 and 3,520
    of 6,000 targets. Dynnibal at the paper's d'/d is compared with SNM at equal memory on its own line."""
    from rag_lab.reproduction.dynnibal import control_lines

    def runs(*r1s, reembedded=0, summary=None):
        return [{"recall": {"1": r}, "reembedded_passages": reembedded, "strategy_summary": summary or {}}
                for r in r1s]

    targets = {"snm": 352, "snm-equal-reencoding": 582, "snm-3x": 1173, "snm-10x": 3520}
    rows = {"dynnibal": runs(0.64, 0.66, 0.62, reembedded=17_472),
            "snm-equal-reencoding": runs(0.60, 0.61, 0.60, reembedded=17_460),
            "snm-3x": runs(0.54, 0.55, 0.53, reembedded=35_190), "snm-10x": runs(0.74, 0.77, 0.72),
            "exhaustive-rare": runs(0.61, 0.63, 0.58, reembedded=18_000)}
    controls, claim = control_lines(rows, 6000, targets)
    assert controls.startswith("The scheduled Dynnibal (17,472 re-embedded) against the equal-cost controls, R@1 (the "
                               "verdict rule, Holm over the 4 that ran): SNM re-encoding as many passages as Dynnibal "
                               "(9.7% device memory, 17,460 re-embedded): ")
    assert ("SNM at 10/3x Dynnibal's device memory (19.6% device memory, 35,190 re-embedded): Dynnibal beats SNM at "
            "10/3x Dynnibal's device memory") in controls
    assert "per-seed differences -10.0 / -11.0 / -9.0; paired t -17.32, p 0.003 (Holm over 4:" in controls
    assert "SNM at 10x Dynnibal's device memory (58.7% device memory, 0 re-embedded): SNM at 10x" in controls
    assert "**not reproduced** here" in claim
    rows["snm-10x"] = runs(0.54, 0.55, 0.53)
    assert "**reproduced** here" in control_lines(rows, 6000, targets)[1]
    rows["snm-10x"] = runs(0.54, 0.70, 0.50)
    assert "**undecided** here" in control_lines(rows, 6000, targets)[1]
    del rows["snm-10x"]
    assert len(control_lines(rows, 6000, targets)) == 1  # the claim needs both memory rows
    rows["dynnibal-paper-ratio"] = runs(0.60, 0.61, 0.59, summary={"low_dim": 11, "host_memory_pct": 17.2,
                                                                   "device_memory_pct": 4.8})
    rows["snm"] = runs(0.50, 0.52, 0.49)
    (*_, paper) = control_lines(rows, 6000, targets)
    assert paper.startswith("Dynnibal with its host cache at the paper's d'/d (11 of the width: 17.2% of the buffer in "
                            "host memory, 4.8% on the device) against SNM at 5.9%, R@1: Dynnibal, host cache at the "
                            "paper's d'/d (128 / 768) beats SNM")


def test_np_gain_picked_from_three_variants_is_decided_with_holm():
    """Seed 003's committed per-seed R-precision (vanilla 21.4 / 4.7 / 26.0, BASE 30.7 / 31.0 / 32.3, CONTRA 32.7 /
    32.3 / 27.7): BASE, the best of three by its mean, +14.0 but undecided."""
    from rag_lab.reproduction.generative import np_gain

    def runs(*rps):
        return [{"datasets": {"seen": {"r_precision": r}}} for r in rps]

    main = {"vanilla": runs(0.214, 0.047, 0.260), "base": runs(0.307, 0.310, 0.323),
            "async": runs(0.20, 0.17, 0.225), "contra": runs(0.327, 0.323, 0.277)}
    (line,) = np_gain(main)
    assert line.startswith("- Seen people, R-precision: Np Decoding BASE 31.3 against vanilla 17.4: **+14.0 points** "
                           "(per seed: +9.3, +26.3, +6.3); seed 003: +4.4 single-hop. A gain of at least 4 points: "
                           "**undecided** (the verdict rule, the best of 3 variants: undecided (Np Decoding BASE")
    assert "paired t 2.24, p 0.154 (Holm over 3: " in line
    main["base"] = runs(0.364, 0.187, 0.420)  # +15 / +14 / +16, the best mean: t 26, p 0.0015 (Holm: 0.0044)
    assert "points: **reached**" in np_gain(main)[0]


def test_contra_above_base_is_decided_by_the_rule():
    """Seed 003's "by a large margin" for CONTRA over BASE, on the committed per-seed R-precision (CONTRA 32.7 / 32.3 /
    27.7, BASE 30.7 / 31.0 / 32.3: differences +2.0 / +1.3 / -4.6, p 0.855): undecided; +3 / +4 / +5: reproduced;
    BASE ahead by 3 / 4 / 5: not reproduced; without CONTRA runs, no line."""
    from rag_lab.reproduction.generative import contra_claim

    def runs(*rps):
        return [{"datasets": {"seen": {"r_precision": r}}} for r in rps]

    main = {"vanilla": runs(0.2, 0.2, 0.2), "base": runs(0.307, 0.310, 0.323), "contra": runs(0.327, 0.323, 0.277)}
    (line,) = contra_claim(main)
    assert line.startswith("- Seen people, R-precision: Np Decoding CONTRA against Np Decoding BASE (seed 003: the "
                           "contrastively trained CE encoder \"further increases the performance by a large margin\"): "
                           "**undecided** (undecided (")
    assert "per-seed differences +2.0 / +1.3 / -4.6; paired t -0.21, p 0.855" in line
    main["contra"] = runs(0.337, 0.350, 0.373)
    assert "**reproduced**" in contra_claim(main)[0]
    main["contra"] = runs(0.277, 0.270, 0.273)
    assert "**not reproduced**" in contra_claim(main)[0]
    assert contra_claim({"base": main["base"], "contra": []}) == []


def test_seed_003s_other_claims_pair_the_right_rows_by_the_rule():
    """Data efficiency: BASE above vanilla by +2 / +4 / +3 at 30% (alone p 0.035, below 0.05) is undecided once Holm
    counts the two shares (0.070); +5 / +6 / +7 at 10% (p 0.009) is reproduced. Parameter efficiency pairs the small
    BASE generator with the large vanilla one (vanilla ahead: not reproduced). Multi-hop reads Recall@2 on bridge-seen,
    not R-precision (level) nor the unseen people (the other way). No runs, no line."""
    from rag_lab.reproduction.generative import efficiency_claims

    def runs(*values, key="rp", dev="seen"):
        return [{"datasets": {dev: {"r_precision": v / 100 if key == "rp" else 0.3, "recall": {key: v / 100}}}}
                for v in values]

    def bridge(r2, rp):
        return [{"datasets": {"bridge-seen": {"r_precision": p / 100, "recall": {"2": r / 100}},
                              "bridge-unseen": {"r_precision": 0.9 - r / 100, "recall": {"2": 0.9 - r / 100}}}}
                for r, p in zip(r2, rp)]

    results = {"fractions": {30: {"vanilla": runs(10, 10, 10), "base": runs(12, 14, 13)},
                             10: {"vanilla": runs(20, 20, 20), "base": runs(25, 26, 27)}},
               "sizes": {"large": {"vanilla": runs(40, 41, 42)}, "small": {"base": runs(35, 35, 35)}},
               "bridge": {"vanilla": bridge((50, 50, 50), (40, 41, 42)), "base": bridge((55, 56, 57), (40, 41, 42))}}
    share30, share10, size, hop = efficiency_claims(results)
    assert share30.startswith("- Data efficiency, 30% of the training questions, seen R-precision: Np Decoding "
                              "BASE above vanilla decoding (seed 003: data-efficient; Holm over the 2 shares): "
                              "**undecided**")
    assert "per-seed differences +2.0 / +4.0 / +3.0; paired t 5.20, p 0.035 (Holm over 2: 0.070)" in share30
    assert "**reproduced**" in share10 and "per-seed differences +5.0 / +6.0 / +7.0" in share10
    assert size.startswith("- Parameter efficiency, seen R-precision: Np Decoding BASE with the smaller generator "
                           "(d 64, 4 heads) above vanilla decoding with the larger one (d 128, 8 heads (the toy "
                           "generator's shape)): **not reproduced**")
    assert "per-seed differences -5.0 / -6.0 / -7.0" in size
    assert hop.startswith("- Multi-hop, bridge-seen Recall@2: Np Decoding BASE above vanilla decoding (seed 003: +5.4 "
                          "Recall@2): **reproduced**")
    assert "Np Decoding BASE 56.0 ± 1.0 vs vanilla decoding 50.0 ± 0.0" in hop
    assert efficiency_claims({"fractions": {}, "sizes": {}, "bridge": {}}) == []


def test_the_committed_report_states_the_rule_as_the_code_does():
    """docs/generated/reproduction.md's "How verdicts are decided" is the generator's RULE, word for word."""
    from pathlib import Path

    from rag_lab.reproduction.verdict import RULE

    doc = (Path(__file__).parent.parent / "docs" / "generated" / "reproduction.md").read_text()
    assert f"## How verdicts are decided\n\n{RULE}\n" in doc
