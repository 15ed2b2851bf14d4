"""The cost model: construction, validation, JSON round trips."""


import numpy as np
import pytest
from hypothesis import given

from ckptopt import ChainCosts, InvalidCosts

from .common.strategies import additive_costs, full_costs

FULL = dict(a=[4, 8], p=[1, 2], sin=[True, False], sout=[0, 1], m=[0, 3], f=[4, 8], b=[5, 6])


def test_fields_are_readonly_int64():
    c = ChainCosts(**FULL, static=10)
    assert c.n == 2 and c.kind == "full" and c.static == 10
    for k in FULL:
        arr = getattr(c, k)
        assert arr.dtype == np.int64 and not arr.flags.writeable
    with pytest.raises(ValueError):
        c.a[0] = 1
    with pytest.raises(AttributeError, match="kind 'full' has no field 'w'"):
        c.w


def test_additive_constructor():
    c = ChainCosts.additive([9, 1], [2, 3], [4, 5], static=1, names=["x", "y"])
    assert c.is_additive and c.names == ("x", "y")
    w, h, q = c.additive_form()
    # w[0] is unused: the kernel arrays zero it
    assert list(w) == [0, 1] and list(h) == [2, 3] and list(q) == [4, 5]


def test_integral_floats_accepted():
    c = ChainCosts.additive([0.0, 1e3], [2.0, 3.0], [4, 5])
    assert list(c.w) == [0, 1000]


@pytest.mark.parametrize(
    "field, value, index, match",
    [
        ("a", [4, -1], 1, "negative"),
        ("f", [4, 1.5], 1, "not an integer"),
        ("b", [float("nan"), 1], 0, "not an integer"),
        ("m", [0, float("inf")], 1, "not an integer"),
        ("sin", [0, 2], 1, "not a flag"),
        ("p", [1, "2"], 1, "not an integer"),
        ("a", [[1], [2]], None, "one-dimensional"),
        ("a", [1, 2, 3], None, "has 3 entries"),
        ("a", "12", None, "sequence of integers"),
        ("a", [1, None], 1, "not an integer"),
    ],
)
def test_bad_values_name_field_and_index(field, value, index, match):
    kw = dict(FULL)
    kw[field] = value
    with pytest.raises(InvalidCosts, match=match) as ei:
        ChainCosts(**kw)
    assert ei.value.field == field
    assert ei.value.index == index
    assert field in str(ei.value)


def test_empty_and_static_errors():
    with pytest.raises(InvalidCosts, match="at least one layer"):
        ChainCosts.additive([], [], [])
    with pytest.raises(InvalidCosts, match="static"):
        ChainCosts.additive([0], [1], [1], static=-1)
    with pytest.raises(InvalidCosts, match="static"):
        ChainCosts.additive([0], [1], [1], static=0.5)
    with pytest.raises(InvalidCosts, match=r"2\*\*60"):
        ChainCosts.additive([0], [2**61], [1])
    with pytest.raises(InvalidCosts, match="names"):
        ChainCosts.additive([0], [1], [1], names=["a", "b"])
    assert issubclass(InvalidCosts, ValueError)


@given(full_costs(max_n=6))
def test_json_round_trip_full(c):
    assert ChainCosts.from_json(c.to_json()) == c


@given(additive_costs(max_n=6))
def test_json_round_trip_additive(c):
    assert ChainCosts.from_json(c.to_json(indent=None)) == c


def test_json_file_round_trip(tmp_path):
    c = ChainCosts(**FULL, static=3, names=["conv", "relu"])
    path = tmp_path / "c.json"
    c.to_json(path)
    back = ChainCosts.from_json(path)
    assert back == c and back.names == ("conv", "relu")


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"kind": "full", "layers": {"a": [1]', "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"format": "other", "layers": {}}', "not a ckptopt cost file"),
        ('{"kind": "full"}', "no 'layers'"),
        ('{"kind": "weird", "layers": {}}', "unknown cost model kind"),
        ('{"kind": "additive", "layers": {"w": [0], "h": [1]}}', "lacks field"),
        ('{"kind": "additive", "layers": {"w": [0], "h": [1], "q": [1], "z": [1]}}', "unknown field"),
        ('{"kind": "additive", "layers": {"w": [0], "h": [-1], "q": [1]}}', "negative"),
    ],
)
def test_corrupt_json(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InvalidCosts, match=match):
        ChainCosts.from_json(path)


def test_missing_file():
    with pytest.raises(InvalidCosts, match="cannot read"):
        ChainCosts.from_json("/nonexistent/costs.json")


def test_truncated_real_file(tmp_path):
    text = ChainCosts(**FULL).to_json()
    path = tmp_path / "t.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(InvalidCosts, match="truncated"):
        ChainCosts.from_json(path)


def test_kernel_arrays_backward_term_is_exactly_additive():
    # Full-model backward terms equal P[i]-P[l]+qb[i]; spot-check a case by hand:
    # layer 0 saves its input (the model input), layer 1 saves output; x0 is kept by nobody.
    c = ChainCosts(a=[10, 20], p=[0, 0], sin=[1, 0], sout=[0, 1], m=[0, 5], f=[0, 0], b=[0, 0])
    P, qb, *_ = c.kernel_arrays
    assert list(P) == [0, 0, 25]  # h0 = 0 (x0 not saved), h1 = m1 + a1 = 25
    assert list(qb) == [0 + 10, 5 + 20 + 20]


def test_checkpoint_pass_fields_default_round_trip_and_price_a_checkpointed_forward():
    # fc/ffc: f/ff in a checkpoint's first pass (design §3). Default f/ff; kept through JSON only
    # where they differ; the forward term of a checkpointed segment's first layer reads fc
    from ckptopt import simulate

    base = dict(a=[10, 10, 10], p=[0, 0, 0], sin=[0, 1, 1], sout=[0, 0, 0], m=[0, 0, 0], f=[10, 100, 10],
                b=[10, 10, 10])
    plain = ChainCosts(**base)
    assert list(plain.fc) == list(plain.f) and list(plain.ffc) == list(plain.ff)
    assert "fc" not in plain.to_dict()["layers"]
    low = ChainCosts(**base, fc=[10, 40, 10], ffc=[10, 40, 10])
    again = ChainCosts.from_json(low.to_json())
    assert list(again.fc) == [10, 40, 10] and list(again.ffc) == [10, 40, 10]
    # plan (1, 2): layer 1 is a checkpointed segment whose forward (input + f) is the peak
    hi, lo = simulate(plain, (1, 2)), simulate(low, (1, 2))
    assert (hi.phase, hi.layer) == ("forward", 1)
    assert hi.peak_bytes - lo.peak_bytes == 60
    assert simulate(plain, ()).peak_bytes == simulate(low, ()).peak_bytes  # unwrapped: f, as before


def test_a_side_tensors_last_gain_round_trips_and_must_not_be_positive():
    base = dict(a=[10, 10, 10], p=[0, 0, 0], sin=[0, 0, 0], sout=[0, 0, 0], m=[0, 0, 0], f=[10, 10, 10],
                b=[10, 10, 10])
    c = ChainCosts(**base, side=[dict(bytes=8, producer=0, consumers=[2], last_gain=-8)])
    assert ChainCosts.from_json(c.to_json()).side[0].last_gain == -8
    with pytest.raises(InvalidCosts, match="last_gain 4 is not an integer at most 0"):
        ChainCosts(**base, side=[dict(bytes=8, producer=0, consumers=[2], last_gain=4)])
    # the whole forward's figure beside it: round-trips, None when it is last_gain, never positive
    c = ChainCosts(**base, side=[dict(bytes=8, producer=0, consumers=[2], last_gain=0, last_gain_full=-8)])
    assert ChainCosts.from_json(c.to_json()).side[0].last_gain_full == -8
    assert c.side_arrays.sdief.tolist() == [-8] and c.side_arrays.sdie.tolist() == [0]
    assert ChainCosts(**base, side=[dict(bytes=8, producer=0, consumers=[2], last_gain=-8)]).side_arrays.sdief.tolist() == [-8]
    with pytest.raises(InvalidCosts, match="last_gain_full 4 is not an integer at most 0"):
        ChainCosts(**base, side=[dict(bytes=8, producer=0, consumers=[2], last_gain_full=4)])


def test_every_field_is_a_keyword_and_an_attribute_under_its_symbol_and_its_name():
    from ckptopt.cost_fields import FULL as TABLE

    c = ChainCosts(**FULL, fpre=[1, 2], fpost=[0, -1])
    for f in TABLE:
        assert getattr(c, f.symbol) is getattr(c, f.name), f.symbol
    by_name = ChainCosts(out_bytes=[4, 8], param_bytes=[1, 2], saves_input=[True, False], saves_output=[0, 1],
                         saved_extra=[0, 3], forward=[4, 8], backward=[5, 6])
    assert by_name == ChainCosts(**FULL)
    with pytest.raises(InvalidCosts, match="given twice"):
        ChainCosts(**FULL, forward=[4, 8])
    with pytest.raises(InvalidCosts, match="no field 'fz'"):
        ChainCosts(**FULL, fz=[1, 1])
    with pytest.raises(InvalidCosts, match="goes with 'fpost'"):
        ChainCosts(**FULL, fpre=[1, 2])
    with pytest.raises(InvalidCosts, match="needs field"):
        ChainCosts(a=[1], p=[0], sin=[1], sout=[0], m=[0], f=[1])


def test_a_cost_file_leaves_out_exactly_the_fields_it_reads_back_as_their_defaults():
    from ckptopt.cost_fields import FULL as TABLE

    c = ChainCosts(**FULL)
    written = c.to_dict()["layers"]
    assert list(written) == [f.symbol for f in TABLE if f.symbol in written]  # in table order
    assert {f.symbol for f in TABLE if f.omit_default} & set(written) == set()
    refined = ChainCosts(**FULL, ff=[3, 8], br=[5, 2], groot=[1, 1])
    again = ChainCosts.from_dict(refined.to_dict())
    assert again == refined and set(refined.to_dict()["layers"]) - set(written) == {"ff", "br", "groot"}
    # ffs defaults to fs when fs is given (every file gives it), else to ff up to the last save
    assert list(ChainCosts(**FULL, ff=[1, 2]).ffs) == [0, 2]
    assert list(ChainCosts(**FULL, ff=[1, 2], fs=[3, 3]).ffs) == [3, 3]


def test_the_design_glossary_is_the_field_table():
    from pathlib import Path

    from ckptopt.cost_fields import glossary

    design = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    block = design.split("<!-- glossary: generated by ckptopt.cost_fields.glossary() -->\n")[1]
    assert block.split("\n<!-- end glossary -->")[0] == glossary(), "regenerate docs/design.md §3's table"
