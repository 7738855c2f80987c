"""What `llmpipe diagnose` prints and draws from a diagnosis."""

from llmpipe.diagnose.analysis import diagnose
from llmpipe.diagnose.report import Limits, Workload
from llmpipe.diagnose.render import diagnosis_figure, fmt_bytes, format_diagnosis
from tests.diagnose.test_analysis import LIMITS, setup, split


def test_text_report_has_split_rates_verdict_and_ranked_levers():
    d = diagnose(Workload(16, 128, 1), split(0.05, 127 * 0.07, 128), setup(), LIMITS)
    text = format_diagnosis(d, "smollm2")
    for part in ("queue", "prefill (TTFT 50 ms)", "decode (ITL 70.0 ms × 127)", "detokenize / stream overhead",
                 "memory bandwidth 20.0 GB/s", "matmul 400 GFLOP/s", "46,080 B per token", f"verdict: {d.verdict}"):
        assert part in text
    ranked = [line.split()[1] for line in text.splitlines() if line[:2].strip().isdigit() and "x " in line]
    assert ranked == [lv.name.split()[0] for lv in d.levers]


def test_figure_has_time_split_and_roofline_with_both_phases():
    s = split(0.5, 127 * 0.07, 128)
    d = diagnose(Workload(256, 128, 1), s, setup(), Limits(bandwidth=20e9, flops=400e9))
    fig = diagnosis_figure(d, "smollm2")
    bars, roof = fig.axes
    assert [b.get_width() for b in bars.patches] == [0.0, 0.5, s.decode_s, s.overhead_s]
    assert roof.get_xlabel() == "arithmetic intensity (FLOP/byte)"
    decode = roof.collections[1].get_offsets()[0]
    r = d.rates
    assert tuple(decode) == (r.decode_step_flops / r.decode_step_bytes, r.decode_step_flops / s.mean_itl_s)


def test_bytes_show_decimal_and_binary_units():
    assert fmt_bytes(26_031_728_640) == "26.03 GB (24.24 GiB)"
    assert fmt_bytes(3_355_443_200) == "3.355 GB (3.125 GiB)"
    assert fmt_bytes(512) == "512 B"
