"""csrc/abi.h is the one definition of what C and Python share: Python reads its defines, and the C
side checks its descriptor structs against them when it compiles (decode_step.c's _Static_asserts)."""

import pytest

from llmpipe.kernels.abi import ABI, read_defines


def test_defines_are_integers_or_sums_and_products_of_earlier_ones():
    assert read_defines("#define A 3 /* why */\n#define B (2 + 4 * A)\n#define C (B - A)\n") == {"A": 3, "B": 14, "C": 11}
    with pytest.raises(ValueError):
        read_defines("#define A (1 / 2)\n")


def test_the_python_side_reads_the_decode_step_layout_from_it():
    from llmpipe.models.llama import decode_step

    assert decode_step.LINEAR_SLOTS == ABI["LINEAR_WORDS"] and decode_step.TABLE_WORD == ABI["LAYER_TABLE_WORD"]
    assert (decode_step.F32, decode_step.GGML, decode_step.ACTS["silu"]) == (ABI["KIND_F32"], ABI["KIND_GGML"],
                                                                             ABI["ACT_SILU"])
    assert ABI["LAYER_WORDS"] == 2 + 4 * ABI["LINEAR_WORDS"] + 4 + 5 + 2
