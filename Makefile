.PHONY: setup demo test lint bench clean

setup:
	bash scripts/setup_env.sh

demo: setup
	.venv/bin/vlm-pack demo

test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .

clean:
	rm -rf .venv build *.egg-info .pytest_cache vlm-pack-report
