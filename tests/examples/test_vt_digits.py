import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vt_digits.py"


def test_smoke_run_writes_table_and_figure(tmp_path):
    spec = importlib.util.spec_from_file_location("vt_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.run(tmp_path, epochs=1, every=2, max_steps=4)
    text = page.read_text()
    assert "| step | series |" in text and "private v̂" in text and "clean v (NOT private)" in text
    assert (tmp_path / "vt_digits.png").stat().st_size > 10_000
