from tests.equivalence import Step, judge


def s(tok: str, top: dict[str, float]) -> Step:
    return Step(tok, top[tok], top)


def test_identical():
    a = [s("x", {"x": -0.1, "y": -2.0}), s("y", {"y": -0.2, "z": -3.0})]
    v = judge(a, list(a))
    assert v.ok and v.identical and v.first_divergence is None


def test_divergence_inside_top_k_is_accepted_and_nothing_after_is_compared():
    a = [s("x", {"x": -0.1, "y": -0.11}), s("q", {"q": -0.1})]
    b = [s("y", {"y": -0.1, "x": -0.12}), s("r", {"r": -0.1})]
    v = judge(a, b)
    assert v.ok and not v.identical and v.first_divergence == 0


def test_divergence_outside_top_k_fails():
    a = [s("x", {"x": -0.1, "z": -3.0})]
    b = [s("y", {"y": -0.1, "x": -3.0})]
    v = judge(a, b)
    assert not v.ok and "position 0" in v.detail


def test_length_mismatch_fails():
    a = [s("x", {"x": -0.1})]
    assert not judge(a, a + a).ok
