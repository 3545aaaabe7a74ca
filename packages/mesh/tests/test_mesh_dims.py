"""`ParallelDims`: parsing, validation, resolution and derived sizes (pure Python, no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from shardforge.mesh import ParallelDims, divisors

LETTERS_HELP = "r=dp_replicate, d=dp_shard, c=cp, t=tp, p=pp, e=ep, x=etp"


# ---------------------------------------------------------------------------------------------- parse: valid
def test_parse_full_layout_sets_every_field():
    dims = ParallelDims.parse("d4t2c2p1e2")
    assert dims == ParallelDims(dp_shard=4, tp=2, cp=2, pp=1, ep=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep, dims.etp) == (1, 4, 2, 2, 1, 2, 1)


def test_parse_fsdp_prefix_is_optional():
    assert ParallelDims.parse("fsdp:d4t2") == ParallelDims(dp_shard=4, tp=2)
    assert ParallelDims.parse("fsdp:d4t2") == ParallelDims.parse("d4t2")


def test_parse_replicate_letter():
    assert ParallelDims.parse("r2d2") == ParallelDims(dp_replicate=2, dp_shard=2)


@pytest.mark.parametrize("spec", ["D4T2", "FSDP:D4T2", "fsdp:D4t2", "  d4t2  ", "t2d4"])
def test_parse_is_case_whitespace_and_order_insensitive(spec):
    assert ParallelDims.parse(spec) == ParallelDims(dp_shard=4, tp=2)


def test_parse_x_is_expert_tensor_parallel():
    dims = ParallelDims.parse("d2t4e2x4")
    assert (dims.tp, dims.ep, dims.etp) == (4, 2, 4)


def test_parse_letters_not_given_keep_defaults():
    dims = ParallelDims.parse("t2")
    assert dims.dp_shard == -1
    assert (dims.dp_replicate, dims.cp, dims.pp, dims.ep, dims.etp) == (1, 1, 1, 1, 1)


def test_parse_explicit_minus_one_dp_shard():
    assert ParallelDims.parse("d-1t2") == ParallelDims(tp=2)


def test_defaults():
    dims = ParallelDims()
    assert dims.dp_shard == -1
    assert (dims.dp_replicate, dims.cp, dims.tp, dims.pp, dims.ep, dims.etp) == (1, 1, 1, 1, 1, 1)


def test_dims_are_frozen():
    dims = ParallelDims(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dims.tp = 4  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- parse: errors
@pytest.mark.parametrize("spec", ["d4z2", "q2", "d4t2y1"])
def test_parse_unknown_letter_lists_valid_letters(spec):
    bad = next(ch for ch in spec if ch.isalpha() and ch not in "rdctpex")
    with pytest.raises(
        ValueError, match=rf"unknown axis letter '{bad}' in layout '{spec}'; valid letters: {LETTERS_HELP}"
    ):
        ParallelDims.parse(spec)


@pytest.mark.parametrize(
    ("spec", "letter", "field"),
    [("d2d2", "d", "dp_shard"), ("t2c2t2", "t", "tp"), ("x1e2x1", "x", "etp"), ("D2d4", "d", "dp_shard")],
)
def test_parse_duplicate_letter(spec, letter, field):
    with pytest.raises(ValueError, match=rf"axis '{letter}' \({field}\) given twice"):
        ParallelDims.parse(spec)


@pytest.mark.parametrize(
    ("spec", "rest"),
    [
        ("d4t", "t"),
        ("d4 t2", " t2"),
        ("4d", "4d"),
        ("d4t2!", "!"),
        ("dt2", "dt2"),
        ("d4_t2", "_t2"),
        ("d4.5", ".5"),
        ("fsdp:d4:t2", ":t2"),
        ("d4fsdp:t2", "fsdp:t2"),
    ],
)
def test_parse_garbage_or_trailing_text_says_where_and_lists_letters(spec, rest):
    with pytest.raises(ValueError, match=rf"cannot parse layout '{spec}' at '{rest}'") as info:
        ParallelDims.parse(spec)
    assert LETTERS_HELP in str(info.value)


@pytest.mark.parametrize("spec", ["", "   ", "fsdp:", "FSDP:  "])
def test_parse_empty_layout(spec):
    with pytest.raises(ValueError, match=r"empty layout .*expected letters\+sizes like 'd4t2'") as info:
        ParallelDims.parse(spec)
    assert LETTERS_HELP in str(info.value)


@pytest.mark.parametrize(("spec", "type_name"), [(None, "NoneType"), (4, "int"), (b"d4", "bytes"), (["d4"], "list")])
def test_parse_non_string_is_type_error(spec, type_name):
    with pytest.raises(TypeError, match=rf"layout must be a string like 'd4t2', got {type_name}"):
        ParallelDims.parse(spec)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        ("t0", "tp", 0),
        ("c-1", "cp", -1),
        ("p0", "pp", 0),
        ("e0", "ep", 0),
        ("x0", "etp", 0),
        ("r-3", "dp_replicate", -3),
    ],
)
def test_parse_zero_or_negative_sizes(spec, field, value):
    with pytest.raises(ValueError, match=rf"{field}={value} is invalid; sizes must be >= 1"):
        ParallelDims.parse(spec)


@pytest.mark.parametrize(("spec", "value"), [("d0", 0), ("d-2", -2), ("d-16t2", -16)])
def test_parse_bad_dp_shard_mentions_minus_one(spec, value):
    with pytest.raises(ValueError, match=rf"dp_shard={value} is invalid; use a positive size or -1 for 'the rest'"):
        ParallelDims.parse(spec)


# ---------------------------------------------------------------------------------------------- constructor checks
@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_constructor_rejects_non_int_sizes(value):
    with pytest.raises(TypeError, match=r"tp must be an int, got "):
        ParallelDims(tp=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["dp_replicate", "cp", "tp", "pp", "ep", "etp"])
def test_constructor_rejects_zero(field):
    with pytest.raises(ValueError, match=rf"{field}=0 is invalid; sizes must be >= 1"):
        ParallelDims(**{field: 0})


def test_constructor_rejects_minus_one_outside_dp_shard():
    with pytest.raises(ValueError, match=r"cp=-1 is invalid"):
        ParallelDims(cp=-1)


def test_constructor_rejects_bad_dp_shard():
    with pytest.raises(ValueError, match=r"dp_shard=0 is invalid"):
        ParallelDims(dp_shard=0)
    with pytest.raises(ValueError, match=r"dp_shard=-2 is invalid"):
        ParallelDims(dp_shard=-2)


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        ParallelDims(1, 2)  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- resolve
@pytest.mark.parametrize(
    ("spec", "world", "dp_shard"),
    [("t2", 8, 4), ("t2c2", 16, 4), ("r2p2", 8, 2), ("p4t8", 32, 1), ("d-1", 1, 1), ("r2c2t2p2", 1024, 64)],
)
def test_resolve_infers_dp_shard(spec, world, dp_shard):
    dims = ParallelDims.parse(spec)
    resolved = dims.resolve(world)
    assert resolved.dp_shard == dp_shard
    assert resolved.world_size == world
    assert dims.dp_shard == -1  # the original is untouched
    assert dataclasses.replace(resolved, dp_shard=-1) == dims


def test_resolve_keeps_explicit_dims():
    dims = ParallelDims.parse("d4t2")
    assert dims.resolve(8) == dims


def test_resolve_not_divisible_lists_divisors():
    with pytest.raises(
        ValueError,
        match=r"world_size=8 is not divisible by pp\*dp_replicate\*cp\*tp=1\*1\*1\*3=3, so dp_shard=-1 cannot be inferred",
    ) as info:
        ParallelDims(tp=3).resolve(8)
    assert "divisors: [1, 2, 4, 8]" in str(info.value)


def test_resolve_not_divisible_counts_every_other_axis():
    # 2*2*2*2 = 16 does not divide 24 even though each factor does.
    with pytest.raises(ValueError, match=r"=2\*2\*2\*2=16.*divisors: \[1, 2, 3, 4, 6, 8, 12, 24\]"):
        ParallelDims.parse("p2r2c2t2").resolve(24)


@pytest.mark.parametrize("world", [0, -4])
def test_resolve_rejects_non_positive_world(world):
    with pytest.raises(ValueError, match=rf"world_size={world} must be >= 1"):
        ParallelDims(tp=1).resolve(world)


def test_resolve_validates_the_result():
    with pytest.raises(ValueError, match=r"etp=4 must be 1 or equal to tp=2"):
        ParallelDims.parse("t2x4").resolve(8)
    with pytest.raises(ValueError, match=r"ep=3 must divide"):
        ParallelDims.parse("t2e3").resolve(8)


# ---------------------------------------------------------------------------------------------- validate
@pytest.mark.parametrize(
    ("spec", "world"),
    [("d8", 8), ("d4t2", 8), ("r2d2c2t2p2", 32), ("d4t2e8", 8), ("d4t2e4x2", 8), ("t2", 8), ("d1", 1)],
)
def test_validate_accepts_consistent_layouts(spec, world):
    ParallelDims.parse(spec).validate(world)  # does not raise


def test_validate_product_mismatch_lists_divisors():
    with pytest.raises(
        ValueError,
        match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*1\*4\*1\*2 = 8, but world_size=16; the product must equal",
    ) as info:
        ParallelDims.parse("d4t2").validate(16)
    assert "set dp_shard=-1 to infer it" in str(info.value)
    assert "divisors of 16: [1, 2, 4, 8, 16]" in str(info.value)


def test_validate_product_too_large():
    with pytest.raises(ValueError, match=r"= 32, but world_size=8.*divisors of 8: \[1, 2, 4, 8\]"):
        ParallelDims.parse("p2r2d2c2t2").validate(8)


def test_validate_with_unresolved_dp_shard_delegates_to_resolve():
    ParallelDims(tp=2).validate(8)
    with pytest.raises(ValueError, match=r"dp_shard=-1 cannot be inferred"):
        ParallelDims(tp=3).validate(8)


@pytest.mark.parametrize(("spec", "world", "etp", "tp"), [("d4t2x4", 8, 4, 2), ("d8x2", 8, 2, 1), ("d2t4x2", 8, 2, 4)])
def test_validate_etp_must_be_one_or_tp(spec, world, etp, tp):
    with pytest.raises(ValueError, match=rf"etp={etp} must be 1 or equal to tp={tp}"):
        ParallelDims.parse(spec).validate(world)


def test_validate_ep_must_divide_shard_cp_tp_when_etp_is_one():
    with pytest.raises(
        ValueError,
        match=r"ep=3 must divide dp_shard\*cp\*tp=8 \(expert parallelism borrows those ranks\); valid ep: \[1, 2, 4, 8\]",
    ):
        ParallelDims.parse("d4t2e3").validate(8)


def test_validate_ep_must_divide_shard_cp_when_etp_is_tp():
    # ep=8 is fine when experts borrow the tp ranks (etp=1) but not when they are tp-sharded (etp=tp).
    ParallelDims.parse("d4t2e8").validate(8)
    with pytest.raises(ValueError, match=r"ep=8 must divide dp_shard\*cp=4 .*valid ep: \[1, 2, 4\]"):
        ParallelDims.parse("d4t2e8x2").validate(8)


def test_validate_ep_counts_cp_ranks():
    ParallelDims.parse("d2c4e8").validate(8)
    with pytest.raises(ValueError, match=r"ep=16 must divide dp_shard\*cp\*tp=8"):
        ParallelDims.parse("d2c4e16").validate(8)


def test_validate_ep_ignores_replicate_and_pp():
    # pool = dp_shard*cp*tp = 2: the replicate and pipeline ranks are not borrowed.
    with pytest.raises(ValueError, match=r"ep=4 must divide dp_shard\*cp\*tp=2 .*valid ep: \[1, 2\]"):
        ParallelDims.parse("p2r2d2e4").validate(8)


# ---------------------------------------------------------------------------------------------- derived sizes
@pytest.mark.parametrize(
    ("spec", "world", "expected"),
    [
        # (world_size, dp, fsdp, dp_cp, efsdp)
        ("d8", 8, (8, 8, 8, 8, 8)),
        ("r2d4", 8, (8, 8, 4, 8, 4)),
        ("d2c2t2", 8, (8, 2, 4, 4, 4)),
        ("r2d2c2t2p2", 32, (32, 4, 4, 8, 4)),
        ("d4c2t2e4", 16, (16, 4, 8, 8, 4)),
        ("d4c2t2e4x2", 16, (16, 4, 8, 8, 2)),
        ("d4c2t2e16", 16, (16, 4, 8, 8, 1)),
        ("p4r4d4c4t4e32", 1024, (1024, 16, 16, 64, 2)),
        ("t8", 8, (8, 1, 1, 1, 1)),
        ("t2", 8, (8, 4, 4, 4, 4)),  # dp_shard inferred
    ],
)
def test_derived_sizes(spec, world, expected):
    dims = ParallelDims.parse(spec).resolve(world)
    assert (dims.world_size, dims.dp, dims.fsdp, dims.dp_cp, dims.efsdp) == expected
    for name, value in zip(("world_size", "dp", "fsdp", "dp_cp", "efsdp"), expected):
        assert dims.size(name) == value


def test_size_of_dense_axes():
    dims = ParallelDims.parse("r2d3c5t7p11e3x7")
    assert [dims.size(a) for a in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")] == [2, 3, 5, 7, 11, 3, 7]


@pytest.mark.parametrize("prop", ["world_size", "dp", "fsdp", "dp_cp", "efsdp"])
def test_unresolved_dims_refuse_derived_sizes(prop):
    dims = ParallelDims(tp=2)
    with pytest.raises(ValueError, match=r"dp_shard=-1 is unresolved; call dims.resolve\(world_size\) first"):
        getattr(dims, prop)
    with pytest.raises(ValueError, match=r"dp_shard=-1 is unresolved"):
        dims.size(prop)


def test_unresolved_dims_still_report_given_sizes():
    dims = ParallelDims(tp=2)
    assert dims.size("tp") == 2
    assert dims.size("dp_shard") == -1


@pytest.mark.parametrize("axis", ["bogus", "TP", "world", "", "ep_pool"])
def test_size_unknown_axis_lists_valid_axes(axis):
    with pytest.raises(ValueError, match=rf"unknown axis '{axis}'; valid axes: \[") as info:
        ParallelDims.parse("d4").size(axis)
    for name in (
        "cp",
        "dp",
        "dp_cp",
        "dp_replicate",
        "dp_shard",
        "efsdp",
        "ep",
        "etp",
        "fsdp",
        "pp",
        "tp",
        "world_size",
    ):
        assert f"'{name}'" in str(info.value)


# ---------------------------------------------------------------------------------------------- to_string / round trip
def test_to_string_uses_fixed_letter_order():
    assert ParallelDims(dp_shard=4, tp=2).to_string() == "r1d4c1t2p1e1x1"
    assert ParallelDims.parse("x2e4p3t2c5d6r7").to_string() == "r7d6c5t2p3e4x2"
    assert ParallelDims().to_string() == "r1d-1c1t1p1e1x1"


ROUND_TRIP = [
    "d8",
    "d-1",
    "t2",
    "r2d2",
    "d4t2",
    "d4t2c2p1e2",
    "fsdp:d4t2",
    "r2d4c2t4p2e4",
    "r4d8c4t4p2e8",
    "p4r4d4c4t4e32",
    "d4c2t2e4x2",
    "d2t4e2x4",
    "p8d8t8e4x8",
    "d1024",
    "d1024e64",
    "c8",
    "p16",
    "r3d5c7",
    "D2T2",
]


@pytest.mark.parametrize("spec", ROUND_TRIP)
def test_to_string_parse_round_trip(spec):
    dims = ParallelDims.parse(spec)
    text = dims.to_string()
    assert ParallelDims.parse(text) == dims
    assert ParallelDims.parse(text).to_string() == text
    assert text.count("x") == 1 and len([c for c in text if c.isalpha()]) == 7


@pytest.mark.parametrize(("spec", "world"), [("d4t2", 8), ("r2d4c2t4p2e4", 128), ("t2", 64), ("r2c2e2", 64)])
def test_round_trip_of_resolved_dims(spec, world):
    resolved = ParallelDims.parse(spec).resolve(world)
    assert ParallelDims.parse(resolved.to_string()) == resolved


# ---------------------------------------------------------------------------------------------- divisors
@pytest.mark.parametrize(
    ("n", "expected"), [(1, [1]), (7, [1, 7]), (12, [1, 2, 3, 4, 6, 12]), (16, [1, 2, 4, 8, 16]), (0, [])]
)
def test_divisors(n, expected):
    assert divisors(n) == expected
