# `make demo` and `make test` set up .venv themselves (pinned versions, CPU torch).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attncomp-installed
JOBS   ?= 2

.PHONY: demo test test-gpu test-gpu-dist venv clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (torch==2.13.0 CPU, pinned dependencies)..."
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# pytest exits 5 when it collects no test: make fails on that like on any other failure.
test: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --durations=10 tests

# On a GPU machine, with its own Python (torch and triton installed there): the GPU tests in their own
# process (the CPU kernel tests switch Triton to its interpreter when imported).
test-gpu:
	python3 -m pytest -q -m gpu tests/codegen/test_triton_gpu.py tests/codegen/test_scfa_gpu.py tests/codegen/test_template_gpu.py tests/e2e/test_gpu_models.py

# On a machine with 2 GPUs: context-parallel attention over NCCL against one GPU (the thread-ring
# checks need only one).
test-gpu-dist:
	python3 -m pytest -q -m gpu tests/distributed/test_context_parallel_gpu.py tests/distributed/test_thread_ring.py

clean:
	rm -rf $(VENV) .pytest_cache
