"""stack_rows and row_slices against torch.cat of the same parts."""

import torch

from llmpipe.layers.rows import row_slices, stack_rows


def test_row_slices_cover_the_rows_in_near_equal_parts():
    for rows, most in [(0, 4), (1, 4), (4, 4), (5, 4), (2048, 512), (2049, 512)]:
        parts = row_slices(rows, most)
        assert parts[0].start == 0 and parts[-1].stop == rows
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        sizes = [p.stop - p.start for p in parts]
        assert max(sizes) <= max(most, 0) and max(sizes) - min(sizes) <= 1
        assert sizes == [len(t) for t in torch.arange(rows).tensor_split(len(parts))]


def test_stack_rows_equals_cat_and_returns_a_whole_part_as_it_is():
    x = torch.randn(10, 3)
    parts = row_slices(10, 4)
    assert torch.equal(stack_rows(10, ((p, x[p] * 2) for p in parts)), torch.cat([x[p] * 2 for p in parts]))
    whole = x * 3
    assert stack_rows(10, iter([(slice(0, 10), whole)])) is whole
