"""``triage diagnose`` end to end on a very small tiny model, and its argument errors."""

import json

from triage.cli import main


def test_diagnose_tiny_writes_table_and_plots(tmp_path, capsys):
    out = tmp_path / "diag"
    code = main(
        [
            "diagnose", "--model", "tiny", "--output", str(out), "--train-steps", "10", "--sequences", "6",
            "--max-new-tokens", "6", "--axes", "precision,kv_cache,alignment", "--device", "cpu",
        ]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "precision" in text and "kv_cache" in text and "strict alignment (bf16)" in text
    data = json.loads((out / "gap_table.json").read_text())
    assert [r["axis"] for r in data["rows"]].count("precision") == 3
    assert data["model"] == "tiny" and data["device"] == "cpu"
    assert (out / "delta_hist.png").exists() and (out / "layer_divergence.png").exists()


def test_diagnose_log_and_errors(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(
        "\n".join(json.dumps({"step": s, "triage/amplify_down/share": 0.01}) for s in range(1, 70))
    )
    assert main(["diagnose", "--log", str(log)]) == 0
    assert "no sustained rise" in capsys.readouterr().out
    log.write_text("\n".join(log.read_text().splitlines()[:39]))  # shorter than the warm-up
    assert main(["diagnose", "--log", str(log)]) == 0
    assert "not evaluated" in capsys.readouterr().out
    assert main(["diagnose"]) == 2
    assert main(["diagnose", "--model", "tiny"]) == 2
    assert (
        main(
            [
                "diagnose",
                "--model",
                "tiny",
                "--output",
                str(tmp_path),
                "--axes",
                "nope",
                "--train-steps",
                "0",
                "--sequences",
                "2",
                "--max-new-tokens",
                "2",
            ]
        )
        == 2
    )
    assert "unknown axes" in capsys.readouterr().err
