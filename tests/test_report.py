import os

from flaxchat.eval.report import Report, append_jsonl, plot_training, read_jsonl


def test_metrics_jsonl_and_chart(tmp_path):
    path = str(tmp_path / "m.jsonl")
    for step in range(1, 6):
        append_jsonl(path, {"step": step, "loss": 5.0 - step * 0.5, "lrm": 1.0, "mfu": 40.0})
    append_jsonl(path, {"step": 5, "val_bpb": 1.7})
    rows = read_jsonl(path)
    assert len(rows) == 6 and rows[-1]["val_bpb"] == 1.7
    png = plot_training(rows, str(tmp_path / "c.png"), title="t")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert plot_training([], str(tmp_path / "none.png")) is None


def test_report_sections_in_pipeline_order(tmp_path):
    report = Report(str(tmp_path))
    chart = tmp_path / "report" / "training.png"
    os.makedirs(chart.parent, exist_ok=True)
    plot_training([{"step": 1, "loss": 3.0}], str(chart))
    report.log("sft", {"val loss": 1.25})
    report.log("pretrain", {"min val bpb": 1.5, "tokens trained": 1234567, "model": "d4"}, charts=[str(chart)])
    report.log("zz-custom", text="free text")
    text = open(report.generate()).read()
    assert text.index("## pretrain") < text.index("## sft") < text.index("## zz-custom")
    assert "| tokens trained | 1,234,567 |" in text and "| min val bpb | 1.5 |" in text
    assert "![pretrain](training.png)" in text and "jax" in text and "git commit" in text
    report.reset()
    assert not [f for f in os.listdir(report.dir) if f.endswith(".md")]
