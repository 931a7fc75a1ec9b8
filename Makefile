.PHONY: setup demo test test-fast lint bench clean matrix wheel

setup:
	bash scripts/setup_env.sh

demo: setup
	.venv/bin/vlm-pack demo

# the main suite, then the torchvision/video-marked tests in their own venv (scripts/test_torchvision.sh:
# torch 2.14.1 + torchvision + av; the first run installs it, see docs/versions.md for the time it takes)
test: setup
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q
	bash scripts/test_torchvision.sh

# the inner loop: every test not marked slow (each module's core behaviour, under a minute on 2 cores)
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

lint: setup
	.venv/bin/ruff check .

# the suite on other transformers releases (scripts/compat_matrix.sh; `make matrix VERSIONS="5.6.2 newest"` picks some)
matrix: setup
	bash scripts/compat_matrix.sh $(VERSIONS)

# python -m build, then the wheel installed in a clean venv outside the repository: import + vlm-pack demo
wheel: setup
	bash scripts/check_wheel.sh

clean:
	rm -rf .venv .venv-tv build *.egg-info .pytest_cache vlm-pack-report
