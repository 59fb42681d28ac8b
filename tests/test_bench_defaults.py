"""`fusionnode bench defaults`: its options, refusals and summary (the run itself is a benchmark)."""

import pytest

from fusionnode.bench import defaults


def test_configs_are_parsed_and_bad_ones_refused(capsys):
    args = defaults.parse_args([])
    assert args.configs == [("simple", "none"), ("fusion", "adatopk")]
    for bad in (["--configs", "fusion:zip,simple:none"], ["--configs", "simple:none"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as info:
            defaults.parse_args(bad)
        assert info.value.code == 2
    assert "--configs" in capsys.readouterr().err


def test_summary_pairs_each_round_with_the_first_configuration():
    runs = [
        {"config": "simple:none", "tokens_per_s": 100.0},
        {"config": "fusion:adatopk", "tokens_per_s": 120.0},
        {"config": "fusion:adatopk", "tokens_per_s": 90.0},
        {"config": "simple:none", "tokens_per_s": 100.0},
    ]
    s = defaults.summarise(runs, ["simple:none", "fusion:adatopk"])
    assert s["ratio_to_first_per_round"] == {"fusion:adatopk": [1.2, 0.9]}
    assert s["never_slower"] == {"fusion:adatopk": False}
    assert s["tokens_per_s"]["fusion:adatopk"] == {"median": 105.0, "min": 90.0, "max": 120.0}
