from example_loader import load_example


def test_smoke_run_writes_table_and_figure(tmp_path):
    module = load_example("vt_digits.py", "vt_digits")
    page = module.run(tmp_path, epochs=1, every=2, max_steps=4)
    text = page.read_text()
    assert "| step | series |" in text and "private v̂" in text and "clean v (NOT private)" in text
    assert (tmp_path / "vt_digits.png").stat().st_size > 10_000
